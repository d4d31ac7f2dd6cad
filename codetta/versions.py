"""The releases of codetta's dependencies it is known to work with, and how to compare them."""

import re

# transformers' releases whose model code codetta.patch follows (5.17 to 5.25 tested); earlier 5.x
# releases lack what it calls (AttentionInterface.get_interface before 5.1) or compute some families
# otherwise (Granite, Ministral 3 in 5.1)
MIN_TRANSFORMERS = (5, 17)


def release(version: str) -> tuple:
    """(major, minor) of a version string such as "3.6.0" or "2.4.0rc1"."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])
