"""The examples in the public docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["spchain", "spchain._backend", "spchain._checks", "spchain._chain_layout", "spchain._chain_sweep",
           "spchain.blockdiag", "spchain.blocksparse", "spchain.chain", "spchain.hmm", "spchain.paths",
           "spchain.semiring", "spchain.sparse"]
TORCH_MODULES = ["spchain.torch._bridge", "spchain.torch._operator", "spchain.torch.blockdiag",
                 "spchain.torch.blocksparse", "spchain.torch.chain", "spchain.torch.crf", "spchain.torch.nn",
                 "spchain.torch.paths", "spchain.torch.pruning", "spchain.torch.semiring", "spchain.torch.sparse"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULES + TORCH_MODULES)
def test_docstring_examples(name):
    if name in TORCH_MODULES:
        pytest.importorskip("torch")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
    assert result.attempted > 0 or name in ("spchain._checks",)
