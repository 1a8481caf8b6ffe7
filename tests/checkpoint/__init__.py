"""Tests of zerojax.checkpoint."""
