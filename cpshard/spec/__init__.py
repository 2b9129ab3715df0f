"""Specs and sequence orders: values that say where each tensor dimension lives; no communication."""
