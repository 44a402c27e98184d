"""Test kit shipped with powerlib: fake sysfs trees with kernel semantics, for downstream tests too.

Nothing here touches real hardware.
"""
