"""Activation bytes a tensor-parallel rank holds for backward (impls/tensor_parallel: gpt split by
torch.distributed.tensor.parallel, `apply_tp`), by formula, exactly as distref.training.measure's
SavedActivations counts them (a DTensor by its local part; the same storage, offset and size once).

Shapes: micro-batch b sequences of s tokens, hidden h, a heads, L blocks, vocabulary V, element size e
(4 for fp32, 8 for fp64; token ids and targets int64: 8), T ranks in the tensor-parallel group, this one
rank r. A split is torch.chunk's (DTensor's Shard): ⌈n/T⌉ per rank, the last ranks fewer, so ranks differ
(V = 11, T = 2: 6 and 5 columns of the logits): n_r below. With sequence parallelism the residual stream
and the layer norms hold s_r = chunk(s) tokens of every sequence; without it s_r = s. Heads and the MLP's
4h units split evenly (the impl requires T to divide a and 4h).

Per micro-batch, without activation checkpointing:

    embed   8·b·s (token ids) + 8·s (positions): each rank looks its rows up from whole (replicated) ids
    block   e·(2·b·s_r·h + 4·b·s_r)  ln1's and ln2's inputs (the residual stream) with mean and rstd:
                                     split along the sequence with sequence parallelism, whole without
            e·2·b·s·h                their outputs, whole on every rank: q/k/v's and the MLP's first
                                     linear's input (with sequence parallelism the all-gathered tensor,
                                     which DTensor keeps for backward)
            e·(4·b·s·h + b·a·s)/T    SDPA's q, k, v, output (the output projection's input, a view of it)
                                     and log-sum-exp, for this rank's a/T heads
            e·8·b·s·h/T              the MLP's hidden (4h/T units) before and after GELU
    head    e·(b·s_r·h + 2·b·s_r)   its layer norm's input, mean and rstd (split along the sequence, or not)
            e·b·s·h                 the output layer's input (the layer norm's output, all-gathered with
                                     sequence parallelism)
    loss    e·b·s·V_r (loss parallel: log-softmax's output, this rank's vocabulary slice) or e·b·s·V
            (the logits all-gathered, whole), 8·b·s for the targets, e for nll_loss's total weight

With activation checkpointing (torch.utils.checkpoint, non-reentrant: what a checkpointed block saves goes
to checkpoint's own hooks, not the measurement's) each block keeps its input alone: 8·b·s for the
embedding's (the ids), e·b·s_r·h for each of the L blocks and the head, and the loss as above.

(A Linear also saves its weight, as weight.t(): of a DTensor parameter, a DTensor view of it whose local
part is a plain view of the parameter's — model state, which the measurement leaves out, as it does any
parameter or view of one.)

Per block, in elements of b·s·h (dropping the b·s statistics), that is
4 + 12/T without sequence parallelism and 2/T + 2 + 12/T with it. Megatron-LM's Table 2 (Korthikanti et
al., arXiv 2205.05198; `distref.cost.activations.megatron_layer_activation_bytes`) counts bytes of 16-bit
activations: sbh·(10 + 24/T) + 5as²b/T, i.e. 5 + 12/T elements plus the score matrices. The 12/T are
the same (q, k 2, v 1, the output projection's input 1, the MLP's 4 + 4 hidden). Of Megatron's 5 whole
ones, 4 are here too (the two layer norms' inputs and outputs) and 1 is the two 1-byte dropout masks,
which distref's gpt has not; its 5as²b/T (scores, softmax, softmax dropout) SDPA does not keep (it
recomputes them from the log-sum-exp). With sequence parallelism Megatron has 34/T = 2·17/T: the layer
norms' inputs (2), dropout masks (1) and the gathered inputs (2) all split; here the layer norms' inputs
split (2/T) but the all-gathered layer-norm outputs are kept whole (2): Megatron keeps the split ones and
all-gathers them again in backward (§4.2.2), DTensor keeps what it gathered. So sequence parallelism saves
less here than in Megatron: 2·(1 − 1/T)·b·s·h·e per block rather than 5·(1 − 1/T)·sbh·2.

Mixed precision (bf16/fp16 autocast over fp32 parameters): the residual stream and the layer norms'
inputs and statistics stay fp32, each colwise Linear saves its own 16-bit cast of its (gathered) input —
q, k and v three of ln1's output — and each rank its weight slices' casts (12·h²/T per block, h·V_r for
the output layer), once per forward; SDPA's kernel saves what `distref.cost.attention` says (on the CPU q,
k, v, output and log-sum-exp, as above), the loss is fp32 (`distref.cost.activations.Saving`). The 2-D
mesh (`--dp-shard`, FSDP2 over the groups: its gathered parameters) has no formula yet.
"""

from __future__ import annotations

from distref.cost.activations import Saving, saving_for
from distref.cost.attention import attention_saves

INDEX_BYTES = 8  # int64 token ids, positions and targets


def chunk(n: int, parts: int, index: int) -> int:
    """How many of `n` rows part `index` of `parts` holds under torch.chunk (DTensor's Shard): ⌈n/parts⌉
    each, the last parts fewer (possibly none)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def tensor_parallel_activation_bytes(
    *,
    micro_batch: int,
    seq: int,
    hidden: int,
    heads: int,
    layers: int,
    vocab: int,
    tp: int,
    tp_rank: int,
    sequence_parallel: bool,
    loss_parallel: bool,
    element_bytes: int = 4,
    checkpointed: bool = False,
    saving: Saving | None = None,
) -> int:
    """The most bytes of activations rank `tp_rank` of a tensor-parallel group of `tp` holds for backward
    in one forward-backward of `micro_batch` sequences (the module docstring's formula, term by term),
    saving as `saving` says (distref.cost.activations.saving_for; by default fp32 or fp64 on the CPU, as
    `element_bytes`). With gradient accumulation each micro-batch's backward frees what its forward saved:
    this is the peak of the step too."""
    if saving is None and element_bytes not in (4, 8):
        raise ValueError(
            f"element_bytes is 4 or 8 (fp32, fp64), not {element_bytes}: give `saving` otherwise"
        )
    sv = saving or saving_for({4: "fp32", 8: "fp64"}[element_bytes])
    b, s, h, a, L, V, t = micro_batch, seq, hidden, heads, layers, vocab, tp
    if not 0 <= tp_rank < t:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of a group of {t}")
    if a % t or (4 * h) % t or h % a:
        raise ValueError(
            f"tp {t} must divide the {a} heads and the MLP's {4 * h} units, heads the {h} hidden"
        )
    s_r = chunk(s, t, tp_rank) if sequence_parallel else s  # tokens of the residual stream held
    v_r = chunk(vocab, t, tp_rank)  # this rank's columns of the logits
    acc, c = sv.accumulate, sv.compute
    loss = acc * b * s * (v_r if loss_parallel else V) + INDEX_BYTES * b * s + acc
    if checkpointed:
        return INDEX_BYTES * b * s + (L + 1) * sv.stream * b * s_r * h + loss
    embed = INDEX_BYTES * b * s + INDEX_BYTES * s
    attention, attention_once = attention_saves(sv.attention, s, h // t, a // t, c, acc)
    q_k_v_inputs = 3 if sv.input_casts else 1  # autocast casts ln1's (gathered) output once for each of them
    block = (
        sv.norm_input_bytes * 2 * b * s_r * h  # layer norms' inputs
        + sv.layer_norm * 4 * b * s_r  # their means and rstds
        + c * (q_k_v_inputs + 1) * b * s * h  # their outputs, whole (gathered with sequence parallelism)
        + b * attention  # SDPA: q, k, v, output, log-sum-exp of a/T heads
        + attention_once
        + c * 8 * b * s * h // t  # the MLP's hidden before and after GELU
        + (c * 12 * h * h // t if sv.weight_casts else 0)  # autocast's casts of this rank's weight slices
        + sv.norm_weights * 4 * h  # (the layer norms' weights and biases, where autocast casts them)
    )
    head = sv.norm_input_bytes * b * s_r * h + sv.layer_norm * 2 * b * s_r + c * b * s * h
    head += c * h * v_r if sv.weight_casts else 0  # (the output layer's weight: this rank's rows)
    head += sv.norm_weights * 2 * h
    return embed + L * block + head + loss
