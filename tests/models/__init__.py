"""Tests of zerojax.models."""
