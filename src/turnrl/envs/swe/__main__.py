"""Set-up for the ``swe`` environment: fetch the pinned libraries and find their bugs.

    python -m turnrl.envs.swe                      # every library, 40 bugs each
    python -m turnrl.envs.swe --libraries toolz --bugs 10

Fills the cache (``$TURNRL_CACHE/swe``, default ``~/.cache/turnrl/swe``) that the
environment would otherwise fill on first use: each sdist, its baseline test run and its
validated bugs (one test run per tried mutation, the slow part). Safe to run again: what is
cached is not redone.
"""

from __future__ import annotations

import argparse
import time

from turnrl.envs.swe.env import LIBRARIES
from turnrl.envs.swe.library import Checkout, cache_root, check_test_python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    parser.add_argument("--bugs", type=int, default=40, help="validated bugs per library")
    args = parser.parse_args()
    check_test_python()
    print(f"swe cache: {cache_root()}")
    for name in args.libraries:
        start = time.perf_counter()
        checkout = Checkout(LIBRARIES[name])
        checkout.fetch()
        passing = len(checkout.baseline().passed())
        bugs = checkout.mutants(args.bugs)
        print(
            f"{checkout.library.key}: {passing} passing tests, {len(bugs)} bugs "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
