"""Conventions of spchain's asv suite (after pandas' and SciPy's suites).

- A benchmark class times one workload of ``spchain.bench``: its parameters are the case and
  the method, spchain's and the baselines it must beat, so each is timed beside the others.
- ``setup`` builds the case's inputs and runs the method once, so kernels are compiled (the
  JIT warm-up) before anything is timed.
- A missing backend (torch, or a CUDA device) raises ``NotImplementedError`` in ``setup``,
  which asv reports as skipped; so does a method that a case does not have, and one that
  takes minutes a run (a method in the case's ``slow`` set, at full size).
- CUDA methods synchronise inside the timed body (the case's callables do).
- ``time_`` for time, ``peakmem_`` for the whole process's resident peak.

``SPCHAIN_BENCH_QUICK=1`` in the environment runs the small sizes of ``--quick``.
"""

import abc
import os


def require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        raise NotImplementedError("needs torch") from None


class WorkloadBenchmark(abc.ABC):
    """Base class: subclasses set ``workload`` and ``params`` = [case names, method names].

    Use it as ``common.WorkloadBenchmark`` so that asv does not discover the (abstract) base.
    """

    param_names = ["case", "method"]
    device = "cpu"
    timeout = 900
    number = 1
    repeat = (3, 10, 60.0)

    def setup(self, case, method):
        require_torch()
        from spchain import bench

        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise NotImplementedError("needs a CUDA device")
        quick = os.environ.get("SPCHAIN_BENCH_QUICK") == "1"
        self.case = bench.make_case(self.workload, case, quick, self.device)
        if method not in self.case.methods:
            raise NotImplementedError(f"{case} has no method {method}")
        if method in self.case.slow and not quick:
            raise NotImplementedError(f"{method} takes minutes a run: `python -m spchain bench` times it once")
        self.run = self.case.methods[method]
        self.run()

    def teardown(self, case, method):
        self.case = self.run = None

    def time_run(self, case, method):
        self.run()

    def peakmem_run(self, case, method):
        self.run()

    @property
    @abc.abstractmethod
    def workload(self) -> str:
        """The name of a workload of ``spchain.bench.WORKLOADS``."""
