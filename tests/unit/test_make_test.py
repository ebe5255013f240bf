"""`make test`: the same sessions as noxfile.py, and the image builds it runs ahead are reused."""

from __future__ import annotations

import ast
import re

from tests.container.podman import ran_a_step
from tests.harness import REPO


def test_make_test_runs_the_noxfile_sessions_in_their_order():
    tree = ast.parse((REPO / "noxfile.py").read_text())
    sessions = next(ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and ast.unparse(node.targets[0]) == "nox.options.sessions")
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    assert re.search(r"^TEST_SESSIONS := (.*)$", makefile, re.M).group(1).split() == sessions


CACHED = """STEP 1/4: FROM localhost/base:ci
STEP 2/4: ARG VERSION
STEP 3/4: RUN pip install .
--> Using cache 74f11c23860ef4fced0557f95c0dbb2d04f19a13816542a91dfeaba8b48899ca
--> 74f11c23860
STEP 4/4: COPY shared shared
--> Using cache 8bb0e54641cf37ff2b154fbee6b63b5ba0a9bc3083439e102b0f28243075c914
--> 8bb0e54641c
COMMIT localhost/x:ci
"""


def test_a_build_served_from_the_cache_is_told_from_one_that_ran():
    assert not ran_a_step(CACHED)
    ran_pip = CACHED.replace("--> Using cache 74f11c23860ef4fced0557f95c0dbb2d04f19a13816542a91dfeaba8b48899ca\n", "")
    assert ran_a_step(ran_pip)
    assert ran_a_step(CACHED.replace("--> Using cache 8bb0e5", "--> 8bb0e5"))  # a COPY of changed files
