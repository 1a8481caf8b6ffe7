"""Tests of zerojax.runtime."""
