"""This rank's micro-batches of a global SequenceBatch, and the roles' outputs back in the
global batch's rows and columns.

Which rows go together (`Batching`):
- by count (max_tokens None): this DP rank's contiguous share of the rows, cut into
  num_microbatches equal parts, each the batch's full width: one shape for every micro-batch;
- by token budget (max_tokens): the rows spread over the DP ranks by their real tokens
  (longest first, each to the rank holding the fewest tokens so far), then each rank's rows
  into micro-batches of at most max_tokens model tokens (first fit, longest first); with
  shared prompts, a prompt's samples move together (`_shared_budget_parts`). Ranks may
  then run different numbers of micro-batches: megatron-core's schedules only meet across DP
  when the gradients are reduced, after the last one. Shapes differ between micro-batches:
  schedule.forward_backward has the pipeline stages send each one's shape with it.

How a budget's micro-batch lays its rows out:
- padded: cut to the columns any of them uses (short rows make a short micro-batch); the
  budget counts rows x columns;
- packed (`pack`): the rows' real tokens one after another in a single row, each sequence
  attending only to its own earlier tokens with positions counting from 0, so no compute goes
  to padding; the budget counts the packed length.
Either way the rows carry document ids and run in the packed THD layout (models/packed.py):
a sequence's logits equal its logits alone, up to summation order.

With shared prompts, a micro-batch's samples of one prompt share one model row:
the prompt once, then each sample's continuation in a block of its own (`_shared_microbatch`),
under a mask that lets every block see the prompt (`shared_prompt`) and RoPE angles that put
every block right after it (`rotary_columns`).

A micro-batch dict holds the model inputs [R, L] (tokens, labels, position_ids,
document_ids; shared_prompt [R, L] and rotary_columns [L] with shared prompts) and, in the
global batch's terms, `rows` [b] (which rows), `col0` (its first column), `token_index`
[b, W] (where the token at (row, col0 + w) sits in the model's output flattened to R * L; -1
on padding) and the per-token tensors [b, W] (response_mask, old_logp, ...). Loss closures
read the model's per-position outputs through `about_token` and `at_last_token`, which give
[b, W] and [b] in that frame for any layout. An expert routing to replay is the one
per-token tensor laid out as the model's positions instead (`routing` [R, L, layers, k]):
the routers read it as they run, not the closures.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarlhf.data.sequences import SequenceBatch
from megarlhf.engine.schedule import rank_rows
from megarlhf.engine.train import TrainEngine
from megarlhf.parallel.mesh import ParallelConfig


@dataclasses.dataclass(frozen=True)
class Batching:
    num_microbatches: int = 1
    """Micro-batches per DP rank (count mode)."""
    max_tokens: int | None = None
    """Token budget of a micro-batch (replaces num_microbatches)."""
    pack: bool = False
    """Pack each micro-batch's sequences into one row instead of padding them (needs a
    budget: it bounds the packed row)."""
    share_prompts: bool = False
    """A micro-batch's rows with one prompt (GRPO's samples of a prompt) run it once, in one
    model row (`_shared_microbatch`); under a token budget the budget counts the shared
    layout's positions and a prompt's samples stay in one micro-batch where it allows
    (`_shared_budget_parts`). Not with packed rows, under context parallelism or in a
    mixture-of-experts model, which keep a model row per sequence."""

    def __post_init__(self):
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.max_tokens is not None and self.num_microbatches != 1:
            raise ValueError("a token budget sets the number of micro-batches: give "
                             "max_tokens or num_microbatches, not both")
        if self.share_prompts and self.pack:
            raise ValueError("packed rows keep a row per sequence: give share_prompts or "
                             "pack, not both")
        if self.pack and self.max_tokens is None:
            raise ValueError("packing needs a token budget (max_tokens) to bound the packed "
                             "rows")


def sequence_multiple(engine: TrainEngine) -> int:
    """What a micro-batch's sequence length must be a multiple of (ParallelConfig's
    sequence_multiple: 2 x CP, times TP under sequence parallelism)."""
    config = engine.spec.transformer
    return ParallelConfig(tensor_parallel=config.tensor_model_parallel_size,
                          sequence_parallel=config.sequence_parallel,
                          context_parallel=config.context_parallel_size).sequence_multiple


def microbatches(engine: TrainEngine, batching: Batching, batch: SequenceBatch,
                 routing: torch.Tensor | None = None, *, response_logits: bool = False,
                 **per_token: torch.Tensor) -> list[dict]:
    """This rank's micro-batches of `batch` with `per_token` tensors [B, T] added, and with
    the expert `routing` [B, T, layers, k] (-1: none) to replay laid out as the model's
    positions (`routing` [R, L, layers, k], -1 on padding). With `response_logits`, each
    also names the model positions whose outputs its response tokens read (`logit_index`,
    flat in R * L): the LM head runs there only (engine/schedule.py)."""
    batch.check_length(engine.spec.model.max_position_embeddings)
    if routing is not None:
        _check_routing(routing, batch, engine.spec.model)
    for name, value in per_token.items():
        if tuple(value.shape) != batch.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the batch is "
                             f"{batch.shape}")
    multiple = sequence_multiple(engine)
    mesh = engine.mesh
    # Mixture-of-experts layers keep a row per sample: their load-balancing loss counts every
    # routed token (a shared prompt would count once), and expert groups that span DP ranks
    # exchange tokens in every layer, so the ranks' micro-batch shapes must agree (each
    # rank's sharing gives its own). (A routing to replay comes with experts only:
    # _check_routing.)
    share = (batching.share_prompts and not engine.spec.model.num_experts
             and engine.spec.transformer.context_parallel_size == 1)

    def shared(parts) -> list[dict]:
        first, end = spans(batch)
        return [_shared_microbatch(batch, list(rows), first, end, model=engine.spec.model,
                                   multiple=multiple, per_token=per_token,
                                   response_logits=response_logits)
                for rows in parts]

    if batching.max_tokens is None:
        parts = rank_rows(batch.shape[0], mesh.dp_size, mesh.dp_rank, batching.num_microbatches)
        if share:
            return shared(parts)
        T = batch.shape[1]
        everything = (torch.zeros(batch.shape[0], dtype=torch.long),
                      torch.full((batch.shape[0],), T))
        return [_microbatch(batch, list(rows), *everything, pack=False, multiple=multiple,
                            per_token=per_token, routing=routing,
                            response_logits=response_logits)
                for rows in parts]
    first, end = spans(batch)
    base = _packed_cost if batching.pack else padded_cost
    cost = lambda span: base(span, multiple)  # noqa: E731
    longest = int((end - first).argmax())  # every rank checks it, so all raise alike
    alone = cost(Span.of(int(first[longest]), int(end[longest])))
    if alone > batching.max_tokens:
        raise ValueError(f"a sequence of {int(end[longest] - first[longest])} tokens ({alone} "
                         f"with its padding) does not fit max_tokens_per_micro_batch="
                         f"{batching.max_tokens}; raise it to at least the longest prompt + "
                         f"response")
    if share:
        return shared(_shared_budget_parts(batch, first, end, batching.max_tokens,
                                           multiple, engine.spec.model, mesh.dp_size,
                                           mesh.dp_rank))
    mine = balance(end - first, mesh.dp_size)[mesh.dp_rank]
    return [_microbatch(batch, rows, first, end, pack=batching.pack, multiple=multiple,
                        per_token=per_token, routing=routing, response_logits=response_logits)
            for rows in fit(mine, first, end, batching.max_tokens, cost)]


def _check_routing(routing: torch.Tensor, batch: SequenceBatch, model) -> None:
    """Here rather than in the routers: one check on the host instead of a device sync at
    every routing."""
    want = (*batch.shape, model.num_layers, model.moe_router_topk)
    if not model.num_experts or tuple(routing.shape) != want:
        raise ValueError(f"routing has shape {tuple(routing.shape)}; this model needs "
                         f"[B, T, layers, k] = {list(want)} and experts "
                         f"(num_experts={model.num_experts})")
    if int(routing.max()) >= model.num_experts or int(routing.min()) < -1:
        raise ValueError(f"routing names experts [{int(routing.min())}, {int(routing.max())}]"
                         f"; this model has {model.num_experts} (-1: none)")


def spans(batch: SequenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real tokens as columns [first, end) [B] each; they must be contiguous."""
    real = batch.attention_mask.bool()
    T = batch.shape[1]
    first = real.long().argmax(1)
    end = T - real.flip(1).long().argmax(1)
    holes = (real.sum(1) != end - first).nonzero().flatten().tolist()
    if holes:
        raise ValueError(f"rows {holes} have padding between real tokens; a row must be "
                         f"[padding | prompt | response | padding]")
    return first, end


def balance(lengths: torch.Tensor, parts: int) -> list[list[int]]:
    """Rows into `parts` lists with near-equal token sums: longest row first, each to the
    part with the fewest tokens so far (the lowest-numbered on ties)."""
    if len(lengths) < parts:
        raise ValueError(f"{len(lengths)} rows cannot feed {parts} DP ranks")
    order = sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r))
    load, out = [0] * parts, [[] for _ in range(parts)]
    for r in order:
        p = min(range(parts), key=lambda i: (load[i], i))
        load[p] += int(lengths[r])
        out[p].append(r)
    return [sorted(part) for part in out]


def _round_up(n: int, multiple: int) -> int:
    return n + (-n % multiple)


class Span(NamedTuple):
    """A micro-batch's rows as its cost sees them: how many, the columns [first, end) they
    use, their real tokens."""

    rows: int
    first: int
    end: int
    tokens: int

    @staticmethod
    def of(first: int, end: int) -> "Span":
        return Span(1, first, end, end - first)

    def add(self, first: int, end: int) -> "Span":
        return Span(self.rows + 1, min(self.first, first), max(self.end, end),
                    self.tokens + end - first)


def padded_cost(span: Span, multiple: int) -> int:
    return span.rows * _round_up(span.end - span.first, multiple)


def _packed_cost(span: Span, multiple: int) -> int:
    return _round_up(span.tokens, multiple)


def fit(rows: list[int], first: torch.Tensor, end: torch.Tensor, budget: int,
        cost) -> list[list[int]]:
    """`rows` into micro-batches whose cost(Span) stays within `budget` (each row alone must
    fit): longest row first, each into the first micro-batch it fits, else a new one. Each
    micro-batch keeps its Span, so a try costs O(1)."""
    order = sorted(rows, key=lambda r: (-int(end[r] - first[r]), r))
    groups: list[tuple[list[int], Span]] = []
    for r in order:
        f, e = int(first[r]), int(end[r])
        for i, (group, span) in enumerate(groups):
            grown = span.add(f, e)
            if cost(grown) <= budget:
                group.append(r)
                groups[i] = (group, grown)
                break
        else:
            groups.append(([r], Span.of(f, e)))
    return [sorted(g) for g, _ in groups]


def _microbatch(batch: SequenceBatch, rows: list[int], first: torch.Tensor, end: torch.Tensor,
                *, pack: bool, multiple: int, per_token: dict,
                routing: torch.Tensor | None, response_logits: bool) -> dict:
    r = torch.tensor(rows)
    c0, c1 = int(first[r].min()), int(end[r].max())
    sub = SequenceBatch(tokens=batch.tokens[r, c0:c1],
                        attention_mask=batch.attention_mask[r, c0:c1],
                        response_mask=batch.response_mask[r, c0:c1])
    real = sub.attention_mask.bool()
    b, W = real.shape
    if pack:
        inputs, index = _packed_inputs(sub.tokens[real], real.sum(1), multiple)
        token_index = torch.full((b, W), -1, dtype=torch.long)
        token_index[real] = index  # row-major, as the tokens were packed
    else:
        L = _round_up(W, multiple)
        inputs = sub.right_padded(L - W).model_inputs()
        token_index = torch.where(real, torch.arange(b * L).view(b, L)[:, :W], -1)
    out = {"tokens": inputs["tokens"], "labels": inputs["labels"],
           "position_ids": inputs["position_ids"], "document_ids": inputs["document_ids"],
           "rows": r, "col0": torch.tensor(c0), "token_index": token_index,
           **{name: value[r, c0:c1] for name, value in per_token.items()}}
    if response_logits:
        # The position before each response token (its logprob's); one position at least,
        # so that a micro-batch without response tokens still has logits to take a loss of.
        read = _position_before(token_index)[sub.response_mask.bool()]
        out["logit_index"] = read.unique() if read.numel() else torch.zeros(1, dtype=torch.long)
    if routing is not None:
        R, L = inputs["tokens"].shape
        model_layout = torch.full((R * L, *routing.shape[2:]), -1, dtype=routing.dtype)
        model_layout[token_index[real]] = routing[r, c0:c1][real]
        out["routing"] = model_layout.view(R, L, *routing.shape[2:])
    return out


def _shared_microbatch(batch: SequenceBatch, rows: list[int], first: torch.Tensor,
                       end: torch.Tensor, *, model, multiple: int, per_token: dict,
                       response_logits: bool) -> dict:
    """The micro-batch of `rows` with one model row per prompt: its rows with the same prompt
    (the tokens before their first response token) share the prompt's tokens but the last,
    and each continues from there in a block of its own, from the last prompt token to its
    end:

        [left padding | prompt[:-1] | prompt[-1] + rest 1 | prompt[-1] + rest 2 | ...]

    Each block attends to the shared tokens (`shared_prompt`) and causally to itself, its
    positions count on from the prompt's, and RoPE places every block at the columns right
    after the prompt (`rotary_columns`, models/gpt.rotary_at): each token sees the keys, at
    the offsets, it sees in its own row, so its outputs are that row's up to summation order.
    The last prompt token, repeated in each block, is the position whose output the first
    response token reads (its logprob, the value before it), one per row as about_token
    needs. n samples of a P-token prompt cost P - 1 + n * (1 + rest) positions instead of
    n * (P + rest); blocks are padded to the longest rest. A row holds m samples, m dividing
    every prompt's count in the micro-batch (`_samples_per_row`); m = 1 is a row per
    sample, in the same form."""
    r = torch.tensor(rows)
    c0, c1 = int(first[r].min()), int(end[r].max())
    tokens = batch.tokens[r, c0:c1]
    start = (first[r] - c0).tolist()
    stop = (end[r] - c0).tolist()
    # Where each row's block starts: its last prompt token (a response has one before it).
    split = (batch.response_mask[r, c0:c1].long().argmax(1) - 1).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(tuple(tokens[i, start[i]:split[i] + 1].tolist()), []).append(i)
    P = max(split[g[0]] - start[g[0]] for g in groups.values())
    S = max(b - a for a, b in zip(split, stop))
    m, L = _samples_per_row([len(g) for g in groups.values()], P, S, multiple, model)
    members = [g[k:k + m] for g in groups.values() for k in range(0, len(g), m)]
    R, W = len(members), c1 - c0
    model_tokens = torch.zeros(R, L, dtype=torch.long)
    positions = torch.zeros(R, L, dtype=torch.long)
    document = -torch.arange(1, L + 1).repeat(R, 1)  # padding: an id of its own each
    shared = torch.zeros(R, L, dtype=torch.bool)
    token_index = torch.full((len(rows), W), -1, dtype=torch.long)
    for g, group in enumerate(members):
        k = split[group[0]] - start[group[0]]  # shared tokens
        model_tokens[g, P - k:P] = tokens[group[0], start[group[0]]:split[group[0]]]
        positions[g, P - k:P] = torch.arange(k)
        document[g, P - k:P] = 0
        shared[g, P - k:P] = True
        for j, i in enumerate(group):
            n, b0 = stop[i] - split[i], P + j * S
            model_tokens[g, b0:b0 + n] = tokens[i, split[i]:stop[i]]
            positions[g, b0:b0 + n] = k + torch.arange(n)
            document[g, b0:b0 + n] = j + 1
            token_index[i, start[i]:split[i]] = g * L + torch.arange(P - k, P)
            token_index[i, split[i]:stop[i]] = g * L + torch.arange(b0, b0 + n)
    # A label is the next token of the same sequence: within the shared tokens and within a
    # block the next column; the last shared token's is the last prompt token, which starts
    # every block; a block's last token has none.
    same = F.pad(document[:, 1:] == document[:, :-1], (0, 1))  # padding ids never repeat
    labels = torch.where(same, F.pad(model_tokens[:, 1:], (0, 1)), 0)
    for g, group in enumerate(members):
        if split[group[0]] > start[group[0]]:
            labels[g, P - 1] = tokens[group[0], split[group[0]]]
    columns = torch.arange(L)
    rotary_columns = torch.where(columns < P, columns, P + (columns - P) % S)
    out = {"tokens": model_tokens, "labels": labels, "position_ids": positions,
           "document_ids": document, "shared_prompt": shared, "rotary_columns": rotary_columns,
           "rows": r, "col0": torch.tensor(c0), "token_index": token_index,
           **{name: value[r, c0:c1] for name, value in per_token.items()}}
    if response_logits:
        read = _position_before(token_index)[batch.response_mask[r, c0:c1].bool()]
        out["logit_index"] = read.unique()
    return out


def _samples_per_row(sizes: list[int], P: int, S: int, multiple: int, model
                     ) -> tuple[int, int]:
    """(m, row length) for groups of `sizes` samples, P shared tokens and blocks of S: each
    model row holds m samples of one prompt, m dividing every group's size, so that every
    row has its m blocks filled and the LM head, which runs at the columns any row reads, runs
    at as many positions as with a row per sample. The largest m whose rows keep no more
    activations than a row per sample: per layer and position 34 h + 5 heads L bytes
    (Korthikanti et al. 2022, sec. 4.1, attention scores kept, as local attention does).
    Attention grows with the square of a row, so long responses after a short prompt may
    leave m = 1, a row per sample. Fewer positions and a bound that weighs attention area
    more than any GPU layout does (flash attention keeps a mask per micro-batch, not scores
    per layer) keep the memory planner's count of a row per sample an upper bound."""
    rows, alone = sum(sizes), _round_up(P + S, multiple)
    h, heads = model.hidden_size, model.num_attention_heads
    kept = lambda R, L: R * L * (34 * h + 5 * heads * L)  # noqa: E731
    divides = math.gcd(*sizes)
    for m in range(divides, 1, -1):
        length = _round_up(P + m * S, multiple)
        if divides % m == 0 and kept(rows // m, length) <= kept(rows, alone):
            return m, length
    return 1, alone


class _Rows(NamedTuple):
    """Rows of one shared micro-batch as its shape depends on them: samples per prompt (by
    prompt id), the most shared tokens (P) and the longest block (S) of _shared_microbatch."""

    rows: tuple[int, ...]
    counts: dict[int, int]
    P: int
    S: int

    def merged(self, other: "_Rows") -> "_Rows":
        counts = dict(self.counts)
        for prompt, n in other.counts.items():
            counts[prompt] = counts.get(prompt, 0) + n
        return _Rows(self.rows + other.rows, counts, max(self.P, other.P),
                     max(self.S, other.S))


def _shared_budget_parts(batch: SequenceBatch, first: torch.Tensor, end: torch.Tensor,
                         budget: int, multiple: int, model, dp_size: int, dp_rank: int
                         ) -> list[list[int]]:
    """This DP rank's micro-batches (lists of rows) under a token budget with shared
    prompts. A micro-batch's cost is its shared layout's model positions (rows x length,
    the prompt counted once per model row), within `budget` as a padded micro-batch's rows x
    columns are (what the memory planner counts: activations per position; the layout keeps
    no more than a row per sample of the same rows would, _samples_per_row).

    Units: a prompt's samples, whole where they fit, else in the fewest equal pieces that
    do; or its rows one by one where no piece holds several samples per model row (long
    responses after a short prompt), so they pack as tightly as rows of their own. Units are
    split further (into pieces that fit) while there are fewer than DP ranks or one costs
    more than a rank's share; spread over the ranks by cost; then each rank's into
    micro-batches, first fit, costliest first. (A row alone fits: the caller checks.)"""
    split = (batch.response_mask.long().argmax(1) - 1).tolist()
    start, stop = first.tolist(), end.tolist()
    ids: dict[tuple, int] = {}
    prompt = [ids.setdefault(tuple(batch.tokens[i, start[i]:split[i] + 1].tolist()), len(ids))
              for i in range(len(start))]

    def cost(unit: _Rows) -> int:
        m, L = _samples_per_row(list(unit.counts.values()), unit.P, unit.S, multiple, model)
        return len(unit.rows) // m * L

    def unit_of(rows: list[int]) -> _Rows:
        return _Rows(tuple(rows), {prompt[rows[0]]: len(rows)},
                     max(split[r] - start[r] for r in rows),
                     max(stop[r] - split[r] for r in rows))

    def pieces(rows: tuple[int, ...], least: int = 1) -> list[_Rows]:
        for n in range(least, len(rows) + 1):
            size = -(-len(rows) // n)
            cut = [unit_of(list(rows[k:k + size])) for k in range(0, len(rows), size)]
            if all(cost(u) <= budget for u in cut):
                return cut
        raise AssertionError("a row alone fits the budget")  # checked by the caller

    by_prompt: dict[int, list[int]] = {}
    for r, p in enumerate(prompt):
        by_prompt.setdefault(p, []).append(r)
    units: list[_Rows] = []
    for rows in by_prompt.values():
        shared = pieces(tuple(rows))
        # Sharing saves positions where a piece's rows hold several samples each; with a row
        # per sample (m = 1) its rows would be padded to the longest: rows alone fit tighter.
        pays = any(cost(u) < len(u.rows) * _round_up(u.P + u.S, multiple) for u in shared)
        units += shared if pays else [unit_of([r]) for r in rows]
    costs = [cost(u) for u in units]
    while True:
        splittable = [u for u in range(len(units)) if len(units[u].rows) > 1]
        over = [u for u in splittable if costs[u] * dp_size > sum(costs)]
        if len(units) < dp_size and splittable:
            pick = max(splittable, key=lambda u: (len(units[u].rows), -u))
        elif over:
            pick = max(over, key=lambda u: (costs[u], -u))
        else:
            break
        cut = pieces(units[pick].rows, least=2)
        units[pick:pick + 1] = cut
        costs[pick:pick + 1] = [cost(u) for u in cut]
    mine = balance(torch.tensor(costs), dp_size)[dp_rank]
    parts: list[_Rows] = []
    for u in sorted(mine, key=lambda u: (-costs[u], u)):
        for k, part in enumerate(parts):
            grown = part.merged(units[u])
            if cost(grown) <= budget:
                parts[k] = grown
                break
        else:
            parts.append(units[u])
    return [sorted(part.rows) for part in parts]


def _packed_inputs(tokens: torch.Tensor, lengths: torch.Tensor, multiple: int
                   ) -> tuple[dict, torch.Tensor]:
    """One row [1, L] of the sequences `tokens` (concatenated, lengths [b]) and each token's
    position in it."""
    n = int(lengths.sum())
    L = _round_up(n, multiple)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = lengths.cumsum(0) - lengths
    positions = torch.arange(n) - starts[doc]
    same_doc_next = torch.cat([doc[1:] == doc[:-1], torch.tensor([False])])
    labels = torch.where(same_doc_next, torch.cat([tokens[1:], tokens[:1]]), 0)
    pad = L - n
    # Padding: token 0, position 0, a document id of its own per position.
    doc = torch.cat([doc, -torch.arange(1, pad + 1)])
    return ({"tokens": F.pad(tokens.long(), (0, pad))[None],
             "labels": F.pad(labels.long(), (0, pad))[None],
             "position_ids": F.pad(positions, (0, pad))[None],
             "document_ids": doc[None]}, torch.arange(n))


def about_token(mb: dict, per_position: torch.Tensor) -> torch.Tensor:
    """[b, W] from the model's per-position outputs [R, L]: at each real token that follows a
    real token, the output at the token before it (the logprob of producing it, the value of
    the state before it); 0 elsewhere."""
    before = _position_before(mb["token_index"])
    return torch.where(before >= 0, per_position.reshape(-1)[before.clamp(min=0)], 0)


def _position_before(token_index: torch.Tensor) -> torch.Tensor:
    """[b, W]: at each real token that follows a real token, the model position (flat) of
    the token before it; -1 elsewhere."""
    before = F.pad(token_index, (1, 0), value=-1)[:, :-1]
    return torch.where((token_index >= 0) & (before >= 0), before, -1)


def at_last_token(mb: dict, per_position: torch.Tensor) -> torch.Tensor:
    """[b]: the output at each row's last real token."""
    index = mb["token_index"]
    last = (index >= 0).long().cumsum(1).argmax(1)  # the first column of the final count
    return per_position.reshape(-1)[index[torch.arange(index.shape[0]), last]]


def to_global(mbs: list[dict], outputs: list[dict], key: str, shape: tuple[int, ...],
              engine: TrainEngine) -> torch.Tensor:
    """`key` of the loss closures' dicts (after from_last_stage) in the global batch's frame
    `shape` ([B, T] per token, [B] per row), on every rank: each rank writes its rows, the DP
    ranks' disjoint rows are summed (adding zeros, exact)."""
    out = torch.zeros(shape, device=engine.mesh.device)
    for mb, o in zip(mbs, outputs, strict=True):
        value = o[key]
        rows = mb["rows"].to(out.device)
        if value.dim() == 1:
            out[rows] = value.to(out.dtype)
        else:
            c0 = int(mb["col0"])
            out[rows, c0:c0 + value.shape[1]] = value.to(out.dtype)
    dist.all_reduce(out, group=engine.mesh.dp_group)
    return out
