"""Tests of zerojax.offload."""
