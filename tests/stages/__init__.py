"""Tests of zerojax.stages."""
