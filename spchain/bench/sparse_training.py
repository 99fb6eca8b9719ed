"""A dense MLP and the same MLP at 90 % ERK sparsity trained with RigL: accuracy and time per epoch.

The figures of the sparse-MLP tutorial (``docs/tutorials/sparse_mlp.rst``) and the README::

    python -m spchain.bench.sparse_training            # full size (a few minutes on 2 cores)
    python -m spchain.bench.sparse_training --quick    # the tutorial's size (seconds)

The task is synthetic (no download): points of a ``features``-dimensional space labelled by a
random two-layer teacher network. Both models have the same architecture and initial weights and
see the same batches; the sparse one is ``sparsify(model, 0.9, distribution="erk")`` and moves
connections with ``prune_and_regrow(regrow="gradient")`` (RigL) every ``every`` steps, the
fraction following ``CosineDropFraction`` to zero at three quarters of training. Each epoch of
the two models alternates (dense, sparse, dense, ...) in one process; the time per epoch is the
median over epochs. torch is imported when :func:`run` is called.
"""

import argparse
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FULL = {"features": 512, "hidden": 2048, "classes": 10, "train": 20480, "epochs": 8, "batch": 256, "every": 50}
QUICK = {"features": 32, "hidden": 256, "classes": 4, "train": 4096, "epochs": 6, "batch": 128, "every": 20}


def teacher_task(features: int, classes: int, train: int, test: int,
                 seed: int = 0) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """``(x_train, y_train, x_test, y_test)``: Gaussian points labelled by a random tanh teacher."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    w1 = torch.randn(features, 2 * features, generator=generator) / features**0.5
    w2 = torch.randn(2 * features, classes, generator=generator) / features**0.5
    x = torch.randn(train + test, features, generator=generator)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x[:train], y[:train], x[train:], y[train:]


def run(features: int, hidden: int, classes: int, train: int, epochs: int, batch: int, every: int,
        sparsity: float = 0.9, seed: int = 0) -> dict[str, float]:
    """Train both models; return their test accuracies, median seconds per epoch, and weight counts."""
    import numpy as np
    import torch

    import spchain.torch as st

    x, y, x_test, y_test = teacher_task(features, classes, train, train // 4, seed)
    torch.manual_seed(seed)
    dense = torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))
    sparse = torch.nn.Sequential(*(torch.nn.Linear(m.in_features, m.out_features) if isinstance(m, torch.nn.Linear)
                                   else m for m in dense))
    sparse.load_state_dict(dense.state_dict())
    st.sparsify(sparse, sparsity, distribution="erk")
    layers = [m for m in sparse if isinstance(m, st.SparseLinear)]
    steps_per_epoch = train // batch
    drop = st.CosineDropFraction(0.3, end_step=3 * epochs * steps_per_epoch // 4)
    models = {"dense": dense, "sparse": sparse}
    optimizers = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for epoch in range(epochs):
        order = torch.randperm(train, generator=torch.Generator().manual_seed(seed + 1 + epoch))
        for name, model in models.items():
            optimizer = optimizers[name]
            start = time.perf_counter()
            for k in range(steps_per_epoch):
                rows = order[k * batch:(k + 1) * batch]
                loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
                optimizer.zero_grad()
                loss.backward()
                at = epoch * steps_per_epoch + k + 1
                if name == "sparse" and at % every == 0 and drop(at) > 0:  # after backward, before step
                    for layer in layers:
                        layer.prune_and_regrow(drop(at), regrow="gradient", optimizer=optimizer)
                optimizer.step()
            times[name].append(time.perf_counter() - start)
    result: dict[str, float] = {}
    for name, model in models.items():
        with torch.no_grad():
            result[f"{name} accuracy"] = (model(x_test).argmax(1) == y_test).float().mean().item()
        result[f"{name} s/epoch"] = float(np.median(times[name]))
    result["dense weights"] = sum(m.weight.numel() for m in dense if isinstance(m, torch.nn.Linear))
    result["sparse weights"] = sum(m.nnz for m in layers)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spchain.bench.sparse_training", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tutorial's small size")
    size = QUICK if parser.parse_args(argv).quick else FULL
    r = run(**size)
    print(", ".join(f"{k}={v}" for k, v in size.items()))
    print(f"weights: dense {r['dense weights']}, sparse {r['sparse weights']} "
          f"({1 - r['sparse weights'] / r['dense weights']:.1%} sparse, ERK)")
    print(f"test accuracy: dense {r['dense accuracy']:.3f}, sparse {r['sparse accuracy']:.3f}")
    print(f"time per epoch: dense {r['dense s/epoch']:.2f} s, sparse {r['sparse s/epoch']:.2f} s "
          f"(dense / sparse = {r['dense s/epoch'] / r['sparse s/epoch']:.2f}x)")


if __name__ == "__main__":
    main()
