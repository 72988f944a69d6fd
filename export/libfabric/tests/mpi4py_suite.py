"""Run mpi4py's own test suite (the test/ directory of its source distribution, unmodified)
with its own runner, leaving out the tests whose id matches the regular expression in
MPI4PY_DESELECT. Usage: mpirun ... python3 mpi4py_suite.py TESTDIR [runtests options].

weft's CI deselects the few tests that fail over Open MPI's mtl/ofi on libfabric's own
providers as well (cli/tests/libfabric.rs names each and why), and runs the rest over weft-fi
and over Open MPI's own transports."""
import os
import re
import sys
import unittest

testdir = sys.argv[1]
sys.path.insert(0, testdir)
import runtests  # noqa: E402  (mpi4py's runner, found in TESTDIR)

deselect = os.environ.get("MPI4PY_DESELECT")
load_all = runtests.load_tests


def load_selected(options, args):
    suite = load_all(options, args)
    if not deselect:
        return suite
    rx = re.compile(deselect)
    kept = unittest.TestSuite()

    def walk(s):
        for t in s:
            if isinstance(t, unittest.TestSuite):
                walk(t)
            elif not rx.search(t.id()):
                kept.addTest(t)

    walk(suite)
    return kept


runtests.load_tests = load_selected
sys.exit(runtests.main(sys.argv[2:]))
