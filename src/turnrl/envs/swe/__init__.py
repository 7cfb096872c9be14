"""``swe``: fix a single-site bug in a real library, checked by the library's own tests.

``mutate`` makes single-site bugs, ``library`` fetches pinned sdists and keeps the bugs
their tests catch, ``runner`` runs a library's tests and reports each outcome, ``env`` is
the environment (tools, sandboxed tests, grading). ``python -m turnrl.envs.swe`` fills the
cache ahead of first use.
"""

from turnrl.envs.swe.env import SWE

__all__ = ["SWE"]
