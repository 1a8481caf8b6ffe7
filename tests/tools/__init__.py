"""Tests of zerojax.tools."""
