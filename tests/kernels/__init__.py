"""Tests of zerojax.kernels."""
