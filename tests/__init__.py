"""Tests of zerojax."""
