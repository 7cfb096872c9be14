"""``swe``: fix a single-site bug in a real library, checked by the library's own tests.

``mutate`` makes single-site bugs, ``library`` fetches pinned sdists and keeps the bugs
their tests catch, ``env`` is the environment (tools, sandboxed tests, grading).
"""

from turnrl.envs.swe.env import SWE

__all__ = ["SWE"]
