"""The chain Ops of ``spchain.chain`` in positional form, for tests that run a forward and its
backward on arrays: ``forward(*inputs) -> results``, ``backward(inputs, results, grads,
needs) -> gradients``, the backward preparing its problem again without checks."""

from spchain.chain import LOGSUMEXP, VITERBI, Messages, prepare_chain


def chain_logsumexp_forward(x, log_trans, log_init=None, lengths=None):
    """``(log_partition, pre, norm)``: ``chain_logsumexp`` and the messages its gradient reads."""
    (log_partition,), saved = LOGSUMEXP.forward(prepare_chain(x, log_trans, log_init, lengths))
    return log_partition, saved.pre, saved.norm


def chain_logsumexp_backward(inputs, results, grads, needs):
    """``(d x, d log_trans, d log_init)`` of ``sum(grads[0] * log_partition)``."""
    return LOGSUMEXP.backward(prepare_chain(*inputs, check=False), Messages(*results[1:]), grads, needs).ordered()


def viterbi_backward(inputs, results, grads, needs):
    """Sub-gradients ``(d x, d log_trans, d log_init)`` of ``sum(grads[0] * score)`` from
    ``spchain.chain.viterbi_forward``'s ``(score, path)``."""
    problem = prepare_chain(*inputs, check=False)
    return VITERBI.backward(problem, VITERBI.restore(results, ()), grads, needs).ordered()
