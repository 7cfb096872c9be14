"""``swe``: fix a single-site bug in a real library, checked by the library's own tests."""
