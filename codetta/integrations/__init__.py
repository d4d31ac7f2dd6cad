"""Integrations of codetta's fused operators into model libraries."""
