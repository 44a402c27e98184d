"""Thin framework integrations (installed as ``powerlib.integrations``).

Each module maps one framework's pipeline-schedule events onto powerlib's runtime hooks and imports
its framework lazily. Nothing is imported here.
"""
