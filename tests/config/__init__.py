"""Tests of zerojax.config."""
