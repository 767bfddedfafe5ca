"""Turns a step's plan into tensors and runs the decoder once over all of it, changing no session.

`prepare` packs every segment's rows (embeddings, 3-D positions, DeepStack features) from the rows the
segment carries (`Segment.source`, put in by the engine core), builds the attention layout (what each
segment may read) and the GDN groups (which state each sequence starts from; deferred chunks with their
turn's conv lead appended, and the live state their join corrects, from `Segment.join_inputs`). `forward`
runs the model and returns the sampled rows' logits (every row of a speculative verify segment) and, for
GDN models, the new states as writes to apply (a verify segment's also after each of its rows), plus what
the deferred join's bookkeeping needs, and, for a drafter that reads them, the final-norm hidden states of
the turns' input and answer rows. The runner reads only the plan and the pools;
only the step's update applies what it returns (engine/update.py): a forward that raises leaves the
caches as they were. With `use_graphs`, decode steps are padded to their bucket (engine/padding.py) and
their forward replayed from a captured graph (engine/graphs.py). A step of hand-off segments runs no
forward: their K/V come from a deferred worker's result, and only the join is computed (`handoff`).

K/V are written into the claimed slots during the forward (they are not visible to anyone until the
update fills those slots)."""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import torch

from ..cache.gdn_state import GDNStatePool
from ..cache.kv_pool import KVPool
from ..deferral.suffix import input_factors
from ..errors import RankFailedError
from ..layers.batch import ForwardBatch
from ..models import DecoderLM
from ..ops.backend import GDNOps, OpSet, select
from ..ops.gdn_traffic import step_traffic
from ..ops.int_lists import long_tensor
from ..ops.uploads import Uploads
from .gdn_inputs import DecodeSteps, Placed, gdn_step, plain_decode
from .graphs import NotCaptured, StepGraphs
from .packing import pack_rows
from .padding import Padded, Scratch, bucket_of, pad
from .plan import Kind, Segment, StepPlan
from .step_inputs import Staged, StepInputs
from .step_outputs import StateWrite, StepOutputs, Tracked


class ModelRunner:
    def __init__(self, model: DecoderLM, kv: KVPool, gdn: GDNStatePool | None, kernel: int, backend: str = "native"):
        self.model = model
        self.backend = backend      # EngineConfig.backend: which op set `select` returns
        self.kv = kv
        self.gdn = gdn
        self.kernel = kernel
        self.key_heads = model.rank_config.linear_num_key_heads
        self.device = model.embed_tokens.weight.device
        self.ops()      # a backend this machine cannot run (fla without triton) fails at load, not at a step
        self.graphs: StepGraphs | None = None     # bucketed, graph-captured decode steps (`use_graphs`)
        self.decode_steps = DecodeSteps()           # the GDN metadata of plain decode steps, reused
        self.padding: Scratch | None = None        # where their padding rows go
        # the GPU path's step metadata, sent in one copy (`prepare`): two staging buffers, one for the step
        # launched last (`uploads`), the other for a step staged beside its forward (`stage(ahead=True)`)
        self.staging = (Uploads(self.device), Uploads(self.device))
        self.uploads = self.staging[0]
        # return the final-norm hidden states of the turns' input and answer rows (`StepOutputs.hidden`), as
        # an MTP drafter reads them (speculative/drafter.py); such steps run eagerly
        self.keep_hidden = False

    def use_graphs(self, capture: bool) -> None:
        """Pad decode steps to their bucket and replay them from captured graphs (`capture`, CUDA), or run
        them eagerly over the same static buffers (the CPU tests). Holds a scratch KV page and GDN slot."""
        self.padding = Scratch.reserve(self.kv, self.gdn)
        self.graphs = StepGraphs(self.model, capture)

    def skip(self) -> None:
        """This rank does not run the pass it was about to (a plan hook raised here): tensor-parallel ranks
        that do run it are told through the plan comparison they make first, and fail it too, instead of
        waiting in its collectives."""
        if self.model.tp is not None:
            # no digest is negative: the others see another plan; this rank fails the pass with the hook's
            # error whatever they saw (a rank gone too)
            with contextlib.suppress(RankFailedError):
                self.model.tp.check_same(-1, "the step's plan")

    def run(self, plan: StepPlan, ops: OpSet) -> StepOutputs:
        """One pass of a step, on the step's op set `ops` (`ops()`, asked once per step)."""
        if self.model.tp is not None:       # tensor-parallel ranks must run the same step (parallel/)
            self.model.tp.check_same(plan.fingerprint(), "the step's plan")
        if plan.segments[0].kind is Kind.HANDOFF:     # a step of its own (`handoff`)
            return self.handoff(plan, ops)
        return self.launch(self.stage(plan, ops))

    def stage(self, plan: StepPlan, ops: OpSet, ahead: bool = False) -> Staged:
        """`plan`'s inputs, built and not sent (`launch` runs it). `ahead`: staged while the step launched last
        may still run on the device, in the staging buffer that step does not use."""
        uploads = self.staging[self.staging[0] is self.uploads] if ahead else self.uploads
        # padding only serves a replay: steps on ops no graph takes run as planned; nor do steps whose
        # hidden states a drafter reads
        bucket = bucket_of(plan) if self.graphs is not None and self.graphs.takes(ops) and not self.keep_hidden \
            else None
        if bucket is None:
            return Staged(plan, ops, self.prepare(plan, ops, send=False, uploads=uploads), uploads)
        padded = pad(plan, bucket, self.padding)
        # sent once the graph's walk has laid out all the batch's tensors (lazily built ones too)
        inputs = self.prepare(padded.plan, ops, padded, send=False, uploads=uploads)
        return Staged(padded.plan, ops, inputs, uploads, bucket, padded, self.graphs.walk(bucket, inputs.batch))

    def launch(self, staged: Staged) -> StepOutputs:
        """Send a staged step's inputs and run its forward (a graph's replay where it has a bucket)."""
        self.uploads = staged.uploads
        inputs, ops, padded = staged.inputs, staged.ops, staged.padded
        if staged.bucket is None:
            if ops.attention.reads_pages:      # the GPU path's inputs are staged (`prepare`)
                self.uploads.send()
            return self.forward(inputs)
        try:
            replayed = self.graphs.run(staged.bucket, inputs.batch, self.uploads.send, staged.walked)
        except NotCaptured:     # the failed capture ran part of the forward over the batch: prepare it again
            self.decode_steps.forget(inputs.batch.gdn)
            return self.forward(self.prepare(padded.plan, ops, padded))
        if replayed is None:
            self.uploads.send()
            return self.forward(inputs)
        batch, logits = replayed
        if batch is inputs.batch:       # the first of its skeleton: its tensors are the graph's buffers now
            self.decode_steps.forget(batch.gdn)
            self.uploads.keep()
        # outputs read from the graph's buffers, which the next replay rewrites: copies of them
        return self.collect(dataclasses.replace(inputs, batch=batch), logits.clone()).detached()

    # ---------------------------------------------------------------- tensors from the plan
    def prepare(self, plan: StepPlan, ops: OpSet, padded: Padded | None = None, send: bool = True,
                uploads: Uploads | None = None) -> StepInputs:
        """The step's tensors; `padded`: `plan` is that padded step's, whose shapes its bucket fixes. On the
        GPU path (FlexAttention, and its CPU twin) the host-built ones go by the step's staged copies
        (`uploads`, default the runner's), sent in one copy at the end (`send`; else the caller sends them)."""
        up = (self.uploads if uploads is None else uploads).begin() if ops.attention.reads_pages else None
        rows = pack_rows(plan, self.model.embed_tokens, self.keep_hidden, padded, up)
        attention = None
        if self.model.config.num_attention_layers:
            layout = ops.attention.layout if padded is None else partial(ops.attention.layout, fixed=padded.groups)
            # a padded step holds no prefill, the only segment whose attention splits (and renumbers the groups)
            segs = plan.attention_segments()
            if ops.attention.reads_pages:
                layout = partial(layout, prefixes=segs.prefixes, pages=segs.pages, uploads=up)
            attention = layout(segs.q_lens, segs.reads, torch.cat([s.write_slots for s in plan.segments]),
                               self.device, self.kv)
        # the GDN groups: a row that joins nothing is a one-row sequence (decode rows), anything else multi-row;
        # in a padded step every chunk is multi-row (it runs filled to its bucket's rows)
        fills = set() if padded is None else set(padded.fills.values())
        placed = [Placed(seg, start, seg.rows > 1 or seg.joins or (padded is not None and seg.kind is Kind.DEFERRED),
                         i in fills) for i, (seg, start) in enumerate(zip(plan.segments, rows.starts, strict=True))]
        gdn = None
        if self.gdn is not None:
            # a padded step's too: the one that becomes a graph's static buffers is forgotten then (`run`)
            gdn = self.decode_steps.step(placed, ops, self.gdn, self.kernel, self.key_heads, self.device,
                                         staged=up is not None) \
                if plain_decode(placed) else \
                gdn_step(placed, ops, self.gdn, self.kernel, self.key_heads, self.device, padded, up)
        put = up.put if up is not None else lambda t: t.to(self.device)
        batch = ForwardBatch(
            embeds=rows.embeds, positions=put(rows.positions), kv=self.kv, ops=ops, attention=attention,
            gdn=gdn, logit_rows=put(long_tensor(rows.logit_rows)),
            deepstack_rows=None if rows.deepstack_rows is None else put(rows.deepstack_rows),
            deepstack=rows.deepstack,
            hidden_rows=put(long_tensor(rows.hidden_rows)) if self.keep_hidden else None,
        )
        inputs = StepInputs(batch, placed, tokens=rows.tokens)
        if gdn is not None and inputs.keep and len(inputs.keep) < len(inputs.single):
            inputs.kept_rows = put(long_tensor([j for j, s in enumerate(inputs.single) if s.tracked]))
        if send and up is not None:
            up.send()
        return inputs

    def ops(self) -> OpSet:
        """The op set for the model's device and dtypes, by `select` (ops/backend.py): asked once per step."""
        gdn = None if self.gdn is None else (self.gdn.conv.dtype, self.gdn.ssm.dtype)
        kv = self.kv.k.dtype if self.model.config.num_attention_layers else None
        return select(self.device, self.model.embed_tokens.weight.dtype, kv, gdn, self.backend)

    # ---------------------------------------------------------------- a deferred worker's result
    def handoff(self, plan: StepPlan, ops: OpSet) -> StepOutputs:
        """A step of hand-off segments (`Scheduler.handoff`): no forward. Each segment's K/V, computed by
        a deferred worker (`Segment.result`), go into its claimed slots; for a GDN model the result's state
        after D is the new prefix state, and the lead is re-run from it and joined into the live state by the
        step's GDN ops, as a chunk's forward does (docs/mechanism.md §5.3): the new states and `S_lead'`
        are outputs, as a forward's are."""
        if any(s.kind is not Kind.HANDOFF for s in plan.segments):
            raise ValueError("hand-off segments run in a step of their own")
        out = StepOutputs(torch.empty(0))     # nothing is sampled
        for seg in plan.segments:
            res = seg.result
            rows = slice(seg.first - res.first, seg.first - res.first + seg.rows)
            self.kv.k[:, seg.write_slots] = res.k[:, rows].to(device=self.device, dtype=self.kv.k.dtype)
            self.kv.v[:, seg.write_slots] = res.v[:, rows].to(device=self.device, dtype=self.kv.v.dtype)
            if seg.joins:
                with torch.inference_mode():     # the lead re-run uses the weights: no autograd graph
                    self._join_result(seg, ops.gdn, out)
        return out

    def _join_result(self, seg: Segment, gdn_ops: GDNOps, out: StepOutputs) -> None:
        """A hand-off segment's GDN part, layer by layer, into `out`: the prefix state set, the live state
        joined, `S_lead'`."""
        pool, jn = self.gdn, seg.join_inputs
        conv0 = seg.result.conv.to(device=pool.conv.device, dtype=pool.conv.dtype)
        ssm0 = seg.result.ssm.to(device=pool.ssm.device, dtype=pool.ssm.dtype)
        convs, lives, leads = [], [], []
        for layer in self.model.gdn_layers():
            i = layer.gdn_index
            conv, state = conv0[i], ssm0[i]
            if seg.lead:
                run = gdn_ops.replay(jn.lead_u[i], jn.lead_g[i], jn.lead_beta[i], layer.conv1d.weight[:, 0], conv,
                                     state, layer.hk, seg.lead)
                conv, state = run.history, run.states[-1]
            lives.append(gdn_ops.join(pool.ssm[seg.live_slot][i], jn.p_rest[i], state - jn.s_lead[i]))
            leads.append(state)
            convs.append(conv)
        out.writes.append(StateWrite([seg.gdn_slot], conv0[None], ssm0[None]))
        # while the lead is incomplete the live conv window still reaches back across the boundary
        out.writes.append(StateWrite([seg.live_slot], torch.stack(convs)[None] if jn.in_lead else None,
                                     torch.stack(lives)[None]))
        out.joined.append((seg, torch.stack(leads)))

    # ---------------------------------------------------------------- the forward
    def forward(self, inputs: StepInputs) -> StepOutputs:
        with torch.inference_mode():
            logits = self.model(inputs.batch)
        return self.collect(inputs, logits)

    def collect(self, inputs: StepInputs, logits: torch.Tensor) -> StepOutputs:
        """The step's outputs from its forward's logits and the GDN buffers it wrote."""
        out = StepOutputs(logits, hidden=inputs.batch.hidden)
        if inputs.batch.gdn is not None:
            self._collect(inputs, out)
        return out

    def _collect(self, inputs: StepInputs, out: StepOutputs) -> None:
        """Layer-by-layer GDN results -> the slots to commit (their new states are in their other rows)
        and the few state writes no kernel made, in the order to apply. Only the few rows the join's
        bookkeeping needs are stacked across layers."""
        res, step = inputs.batch.gdn.out, inputs.batch.gdn
        # every sequence wrote its slot's other row (a joined chunk: its prefix slot's); padding rows
        # wrote the scratch slot's, which stays as it is
        out.committed = [p.segment.gdn_slot for p in inputs.placed if p.segment.kind is not Kind.PADDING]
        if inputs.joins:
            mo = res.multi
            # a join's corrected live state (and, within the lead, its conv history) is written only
            # where no decode row of its turn in this step starts from it and writes its own state
            decoding = {seg.session for seg in inputs.single if seg.kind is Kind.DECODE}
            alone = [j for j, seg in enumerate(inputs.joins) if seg.session not in decoding]
            if alone:
                at = None if len(alone) == len(inputs.joins) else torch.tensor(alone, device=self.device)
                out.writes.append(StateWrite([inputs.joins[j].live_slot for j in alone], None,
                                             mo.corrected if at is None else mo.corrected[at]))
            repair = [j for j in alone if inputs.joins[j].join_inputs.in_lead]
            if repair:      # buffer row j: joined chunk j's history after its lead
                out.writes.append(StateWrite([inputs.joins[j].live_slot for j in repair],
                                             mo.tails[torch.tensor(repair, device=self.device)], None))
            out.joined = [(seg, mo.finals[j]) for j, seg in enumerate(inputs.joins)]
        if step.single is not None and inputs.keep:
            out.tracked = self._tracked(inputs, res.factors)
        if res.at_rows is not None:     # each prefill's checkpoints, every layer's side by side
            conv, ssm = res.at_rows
            at = 0
            for seg in inputs.multi:
                m = len(seg.checkpoints)
                if m:
                    out.checkpoints.append((seg, conv[at:at + m], ssm[at:at + m]))
                    at += m
        # what the update copies: the writes, and the join's records of S_lead' and of the lead's states
        copies = sum(t.nbytes for w in out.writes for t in (w.conv, w.ssm) if t is not None)
        copies += sum(s.nbytes for _, s in out.joined) + sum(t.state.nbytes for t in out.tracked if t.state is not None)
        out.gdn_traffic = step_traffic(step, 2 * copies)
        if inputs.inputs:
            kept = {seg: ssm for seg, _, ssm in out.checkpoints if seg.kind is Kind.VERIFY}
            with torch.inference_mode():
                out.tracked += self._tracked_inputs(inputs, kept)

    def _tracked_inputs(self, inputs: StepInputs, kept: dict[Segment, torch.Tensor]) -> list[Tracked]:
        """The tracked multi-row rows (a follow-up's input, a verify segment), one `Tracked` per row
        (deferral/suffix.py): recomputed from the live state before the step, which the update has not
        replaced yet. A verify segment's lead states are those its forward kept (`kept`: the states after
        each row but the last; the last's is its slot's written row), the very states the turn goes on
        from, as a decode row's are."""
        factors, out, at = inputs.batch.gdn.out.input_factors, [], 0
        layers = self.model.gdn_layers()
        for seg in inputs.inputs:
            lead = min(seg.rows, seg.tracking.lead)
            part = slice(at, at + seg.rows)
            f = input_factors(layers, [x[0][part] for x in factors], [x[1][part] for x in factors],
                              [x[2][part] for x in factors], self.gdn.conv[seg.gdn_slot], self.gdn.ssm[seg.gdn_slot],
                              0 if seg in kept else lead, inputs.batch.ops.gdn)
            at += seg.rows
            if seg in kept:
                last = self.gdn.ssm.rows[self.gdn.rows([seg.gdn_slot]).write[0]]
                states = [kept[seg][j] if j < seg.rows - 1 else last for j in range(lead)]
            else:
                states = list(f.states[:lead]) if lead else []
            out += [Tracked(seg, f.u[j], f.k[j], f.v[j], f.g[j], f.beta[j], states[j] if j < lead else None, j)
                    for j in range(seg.rows)]
        return out

    def _tracked(self, inputs: StepInputs, factors: list[tuple[torch.Tensor, ...]]) -> list[Tracked]:
        """The tracked decode rows' factors, stacked across layers: only what the join will read (u of
        lead tokens, v when a join audits), and gathered only when some one-row sequence is not tracked. k
        stays per key head: the join widens it to value heads once per fold, not per token."""
        segs = inputs.keep
        every = len(segs) == len(inputs.single)     # else the tracked rows' positions among the one-row ones
        keep = inputs.kept_rows
        lead = [j for j, seg in enumerate(segs) if seg.tracking.in_lead]

        def stacked(part: int, needed: bool = True) -> torch.Tensor | None:
            if not needed:
                return None
            t = torch.stack([f[part] for f in factors], dim=1)                     # [N, layers, ...]
            return t if every else t[keep]

        audit = any(seg.tracking.audit for seg in segs)
        u, g, beta = stacked(0, bool(lead)), stacked(3), stacked(4)
        x = inputs.batch.gdn.out.x
        if x is None:       # the torch path: the layers handed over k (per key head) and v
            k, v = stacked(1), stacked(2, audit)
        else:               # the kernel wrote each row's [q | k | v] for every layer: gather k (and v) once
            heads, dk, dv = self.gdn.ssm.shape[2:]
            kd = self.key_heads * dk
            rows = inputs.batch.gdn.single.layout.step_rows(x.shape[1])
            at = rows if every else keep if rows is None else rows[keep]
            xt = x.transpose(0, 1)                                              # [rows, layers, C]

            def columns(cols: slice, shape: tuple[int, int]) -> torch.Tensor:
                # [N, layers, ...] in memory of its own: the joins keep each row's k until they fold it
                # (deferral/gdn_join.py), and a view would keep the step's whole [q | k | v] with it
                part = xt[:, :, cols].contiguous() if at is None else xt[at, :, cols]
                return part.unflatten(-1, shape)
            k = columns(slice(kd, 2 * kd), (self.key_heads, dk))
            v = columns(slice(2 * kd, None), (heads, dv)) if audit else None
        states: list[torch.Tensor | None] = [None] * len(segs)
        # only lead tokens need the state after them: the row their step wrote (current once committed)
        for j, row in zip(lead, self.gdn.rows(segs[j].gdn_slot for j in lead).write, strict=True):
            states[j] = self.gdn.ssm.rows[row]
        none = (None,) * len(segs)
        return list(map(Tracked, segs, none if u is None else u.unbind(0), k.unbind(0),
                        none if v is None else v.unbind(0), g.unbind(0), beta.unbind(0), states))

