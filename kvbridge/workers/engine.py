"""The reference inference engine: paged prefill/decode over a :class:`KVPool`, and a
continuous-batching :class:`Scheduler`.

:class:`Engine` is stateless apart from the pool: a request is its block table and
token count, so KV computed by one engine (prefill side) and copied block by block
into another pool (decode side) continues there exactly. Numerics:

- prefill of the same prompt with the same ``chunk_size`` writes bitwise identical
  KV and logits in every process with the same torch build and thread count;
- different chunkings agree to float tolerance;
- a decode step's result for one request may differ in the last bits with the
  batch it runs in (GEMM shapes), never in anything greedy decoding can see
  except on near-exact ties.

The engine never sets torch's thread count; callers do.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from ..errors import ConfigError, PoolError
from ..pool import KVPool
from .model import CausalLM, SeqPiece
from .sampling import SamplingParams, sample_batch, sample_token

__all__ = ["Engine", "Request", "RequestState", "FinishReason", "Scheduler", "DecodeItem"]

log = logging.getLogger("kvbridge.workers")

# (block_table, seq_len = tokens already cached, last_token = the token to feed)
DecodeItem = tuple[Sequence[int], int, int]
TokenIds = Union[Sequence[int], torch.Tensor]


class Engine:
    """A model plus the pool its KV lives in."""

    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        model.check_pool(pool)
        self.model = model
        self.pool = pool

    @property
    def block_size(self) -> int:
        return self.pool.layout.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens of KV."""
        return -(-num_tokens // self.block_size)

    def forward(self, pieces: Sequence[SeqPiece]) -> torch.Tensor:
        """One forward pass over several sequences' new tokens; see :meth:`CausalLM.forward`."""
        logits: torch.Tensor = self.model(pieces, self.pool)
        return logits

    def prefill(self, prompt_ids: TokenIds, block_ids: Sequence[int], chunk_size: Optional[int] = None,
                num_cached: int = 0) -> torch.Tensor:
        """Write the KV of ``prompt_ids[num_cached:]`` into ``block_ids``; return the last
        position's logits (vocab,) float32.

        ``chunk_size`` splits the work into chunks starting at ``num_cached + k*chunk_size``.
        ``num_cached`` tokens' KV must already be in the blocks (prefix reuse, recompute).
        """
        ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        n = len(ids)
        if not 0 <= num_cached < n:
            raise ConfigError(f"num_cached {num_cached} must be in [0, {n}) for a {n}-token prompt")
        if len(block_ids) < self.blocks_needed(n):
            raise PoolError(f"{len(block_ids)} blocks cannot hold {n} tokens "
                            f"({self.blocks_needed(n)} needed)")
        step = chunk_size or n
        if step <= 0:
            raise ConfigError("chunk_size must be positive")
        logits = torch.empty(0)
        for s in range(num_cached, n, step):
            logits = self.forward([SeqPiece(block_ids, s, ids[s:s + step])])[0]
        return logits

    def decode_step(self, batch: Sequence[DecodeItem]) -> torch.Tensor:
        """One decode step over several requests: logits (B, vocab) float32.

        Each item is ``(block_table, seq_len, last_token)``: ``seq_len`` tokens' KV is in
        the blocks, ``last_token`` goes to position ``seq_len`` (its KV is appended), so
        the table must hold ``seq_len + 1`` tokens.
        """
        if not batch:
            return torch.empty(0, self.model.config.vocab_size)
        return self.forward([SeqPiece(bt, n, [tok]) for bt, n, tok in batch])

    def generate(self, prompt_ids: TokenIds, params: SamplingParams = SamplingParams(),
                 chunk_size: Optional[int] = None, eos_id: Optional[int] = None) -> list[int]:
        """Generate for one prompt alone (allocates and frees its blocks); for tests and tools."""
        ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        blocks = self.pool.alloc(self.blocks_needed(len(ids) + params.max_tokens - 1))
        g = torch.Generator() if params.seed is not None else None
        try:
            out = [sample_token(self.prefill(ids, blocks, chunk_size), params, 0, g)]
            n = len(ids)
            while len(out) < params.max_tokens and not _stops(out[-1], params, eos_id):
                out.append(sample_token(self.decode_step([(blocks, n, out[-1])])[0], params, len(out), g))
                n += 1
            return out
        finally:
            self.pool.free(blocks)


def _stops(tok: int, params: SamplingParams, eos_id: Optional[int]) -> bool:
    return tok in params.stop_set or (not params.ignore_eos and eos_id is not None and tok == eos_id)


class RequestState(str, enum.Enum):
    WAITING = "waiting"      # queued, no blocks yet
    PREFILL = "prefill"      # admitted, prompt partly computed
    DECODE = "decode"        # generating
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"            # EOS or a stop token
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """One generation request and its progress. Times come from the scheduler's clock."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival_time: Optional[float] = None
    keep_blocks: bool = False  # when finished, leave block_ids allocated for the caller (to publish)
    state: RequestState = RequestState.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in block_ids
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish_time: Optional[float] = None
    finish_reason: Optional[FinishReason] = None
    error: Optional[BaseException] = None  # why the scheduler aborted it (its own forward or sampling failed)
    _gen: Optional[torch.Generator] = field(default=None, init=False, repr=False)
    _budget: int = field(default=0, init=False, repr=False)  # blocks reserved for the whole request

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if self.params.seed is not None:
            self._gen = torch.Generator()

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def first_token_time(self) -> Optional[float]:
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from arrival to the first output token."""
        if self.arrival_time is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean seconds per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies in seconds."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Scheduler:
    """Continuous batching over one :class:`Engine`.

    Each :meth:`step` runs one decode step for every running request (one batched
    forward), then prompt chunks of ``chunk_size`` tokens (each its own forward, so a
    request's KV is bitwise that of ``Engine.prefill(prompt, blocks, chunk_size)``)
    while ``max_batched_tokens`` allows; the first chunk of a step always runs.
    A request is admitted only when the pool can hold its prompt plus ``max_tokens``,
    so running requests never run out of blocks and nothing is preempted.
    Finished requests free their blocks unless ``keep_blocks`` is set.
    A request whose own forward or sampling raises (a token id the model cannot embed) is
    aborted alone, with ``error`` set; a failed batched decode step is rerun request by
    request to find it, and the others go on.
    ``add_request``/``add_prefilled``/``abort`` may be called from other threads.
    """

    def __init__(self, engine: Engine, chunk_size: Optional[int] = None,
                 max_batched_tokens: Optional[int] = None, max_num_seqs: int = 256,
                 eos_id: Optional[int] = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if chunk_size is not None and chunk_size <= 0:
            raise ConfigError("chunk_size must be positive")
        self.engine = engine
        self.chunk_size = chunk_size
        self.max_batched_tokens = max_batched_tokens or chunk_size
        self.max_num_seqs = max_num_seqs
        self.eos_id = engine.model.config.eos_id if eos_id is None else eos_id
        self.clock = clock
        self._lock = threading.Lock()
        self.waiting: deque[Request] = deque()
        self.ready: deque[Request] = deque()  # prefilled elsewhere, blocks held, waiting for a slot
        self.running: list[Request] = []  # admission order
        self._reserved = 0  # blocks promised to running requests but not yet allocated
        self._stepping = False
        self._aborts: set[str] = set()  # running requests to abort when the current step ends
        self.num_steps = 0

    # -- intake ---------------------------------------------------------------------------
    def _budget_for(self, req: Request, num_tokens: int) -> int:
        return self.engine.blocks_needed(num_tokens + req.params.max_tokens - 1)

    def add_request(self, req: Request) -> Request:
        """Queue a request for prefill and decode."""
        if not req.prompt_ids:
            raise ConfigError("a request needs at least one prompt token")
        need = self._budget_for(req, len(req.prompt_ids))
        if need > self.engine.pool.num_blocks:
            raise PoolError(f"request {req.request_id} needs {need} blocks, pool has "
                            f"{self.engine.pool.num_blocks}", hint="lower max_tokens or enlarge the pool")
        if req.arrival_time is None:
            req.arrival_time = self.clock()
        req.state = RequestState.WAITING
        with self._lock:
            self.waiting.append(req)
        return req

    def add_prefilled(self, req: Request, block_ids: Sequence[int], num_tokens: int, first_token: int,
                      first_token_time: Optional[float] = None) -> Request:
        """Continue a request whose prompt KV (``num_tokens`` tokens) is already in ``block_ids``
        of this pool and whose first output token was sampled elsewhere.

        The scheduler takes over the caller's reference to ``block_ids`` and frees them when
        the request finishes (unless ``keep_blocks``).
        """
        if len(block_ids) < self.engine.blocks_needed(num_tokens):
            raise PoolError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens")
        now = self.clock()
        if req.arrival_time is None:
            req.arrival_time = now
        req.block_ids = list(block_ids)
        req.num_computed = num_tokens
        req.output_ids = [int(first_token)]
        req.token_times = [now if first_token_time is None else first_token_time]
        req._budget = max(self._budget_for(req, num_tokens), len(req.block_ids))
        if self._done_after(req, req.output_ids[-1]):
            self._finish(req, now)
            return req
        req.state = RequestState.DECODE
        with self._lock:
            self.ready.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Finish a request with ``FinishReason.ABORTED`` and free its blocks; False if unknown
        or done. A running request aborted during a step (from another thread) ends after it."""
        with self._lock:
            for q in (self.waiting, self.ready):
                for r in q:
                    if r.request_id == request_id:
                        q.remove(r)
                        if r.state is RequestState.DECODE:  # ready: holds blocks, not reserved
                            self._finish(r, self.clock(), FinishReason.ABORTED)
                        else:
                            r.state, r.finish_reason = RequestState.FINISHED, FinishReason.ABORTED
                            r.finish_time = self.clock()
                        return True
            for r in self.running:
                if r.request_id == request_id:
                    if self._stepping:
                        self._aborts.add(request_id)
                    else:
                        self._drop(r, FinishReason.ABORTED)
                    return True
        return False

    def _drop(self, r: Request, reason: FinishReason) -> None:
        """Finish a running request (lock held)."""
        self.running.remove(r)
        self._reserved -= r._budget - len(r.block_ids)
        self._finish(r, self.clock(), reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.ready or self.running)

    # -- the loop ---------------------------------------------------------------------------
    def _admit(self) -> None:
        pool = self.engine.pool
        with self._lock:
            while self.ready and len(self.running) < self.max_num_seqs:
                r = self.ready[0]
                extra = r._budget - len(r.block_ids)
                if pool.num_free - self._reserved < extra:
                    break
                self.ready.popleft()
                self._reserved += extra
                self.running.append(r)
            while self.waiting and not self.ready and len(self.running) < self.max_num_seqs:
                r = self.waiting[0]
                need = self._budget_for(r, len(r.prompt_ids))
                if pool.num_free - self._reserved < need:
                    break
                self.waiting.popleft()
                r._budget = need
                self._reserved += need
                r.state = RequestState.PREFILL
                self.running.append(r)

    def _ensure_blocks(self, r: Request, num_tokens: int) -> bool:
        n = self.engine.blocks_needed(num_tokens) - len(r.block_ids)
        if n <= 0:
            return True
        try:
            r.block_ids.extend(self.engine.pool.alloc(n))
        except PoolError:  # someone else took blocks from a shared pool; try next step
            return False
        self._reserved -= n
        return True

    def step(self) -> list[Request]:
        """One scheduling iteration; returns the requests that got a token or finished."""
        self._admit()
        touched: list[Request] = []
        with self._lock:
            running = list(self.running)
            self._stepping = True
        try:
            self._run_step(running, touched)
        finally:
            with self._lock:
                self._stepping = False
                for r in [r for r in self.running if r.request_id in self._aborts]:
                    self._drop(r, FinishReason.ABORTED)
                    touched.append(r)
                self._aborts.clear()
        self.num_steps += 1
        return touched

    def _run_step(self, running: list[Request], touched: list[Request]) -> None:
        dec = [r for r in running if r.state is RequestState.DECODE
               and self._ensure_blocks(r, r.num_computed + 1)]
        if dec:
            try:
                logits = self.engine.decode_step([(r.block_ids, r.num_computed, r.output_ids[-1]) for r in dec])
                toks: list[Optional[int]] = list(sample_batch(
                    logits, [r.params for r in dec], [len(r.output_ids) for r in dec], [r._gen for r in dec]))
            except Exception:  # one request's input breaks the batch: find it, keep the others
                toks = [self._decode_alone(r, touched) for r in dec]
            now = self.clock()
            for r, t in zip(dec, toks):
                if t is None:
                    continue
                r.num_computed += 1
                self._emit(r, t, now)
                touched.append(r)
        budget = self.max_batched_tokens
        ran = False
        for r in running:
            if r.state is not RequestState.PREFILL:
                continue
            n = len(r.prompt_ids) - r.num_computed
            if self.chunk_size:
                n = min(n, self.chunk_size)
            if ran and budget is not None and n > budget:
                break
            if not self._ensure_blocks(r, r.num_computed + n):
                continue
            s = r.num_computed
            ran = True
            if budget is not None:
                budget -= n
            try:
                logits = self.engine.forward([SeqPiece(r.block_ids, s, r.prompt_ids[s:s + n])])[0]
                first = sample_token(logits, r.params, 0, r._gen) if s + n == len(r.prompt_ids) else None
            except Exception as exc:
                self._fail(r, exc, touched)
                continue
            r.num_computed += n
            if first is not None:
                r.state = RequestState.DECODE
                self._emit(r, first, self.clock())
                touched.append(r)

    def _decode_alone(self, r: Request, touched: list[Request]) -> Optional[int]:
        """One request's decode step and sample on its own; None (and the request aborted) if it fails.
        Rewriting the KV at ``r.num_computed`` that the failed batch may have written is harmless."""
        try:
            logits = self.engine.decode_step([(r.block_ids, r.num_computed, r.output_ids[-1])])[0]
            return sample_token(logits, r.params, len(r.output_ids), r._gen)
        except Exception as exc:
            self._fail(r, exc, touched)
            return None

    def _fail(self, r: Request, exc: Exception, touched: list[Request]) -> None:
        """Abort one running request whose own forward or sampling raised; the step goes on."""
        log.warning("request %s aborted: its step failed: %s: %s", r.request_id, type(exc).__name__, exc)
        r.error = exc
        with self._lock:
            if r in self.running:
                self._drop(r, FinishReason.ABORTED)
        touched.append(r)

    def _done_after(self, r: Request, tok: int) -> bool:
        if _stops(tok, r.params, self.eos_id):
            r.finish_reason = FinishReason.STOP
            return True
        if len(r.output_ids) >= r.params.max_tokens:
            r.finish_reason = FinishReason.LENGTH
            return True
        return False

    def _emit(self, r: Request, tok: int, now: float) -> None:
        r.output_ids.append(tok)
        r.token_times.append(now)
        if self._done_after(r, tok):
            with self._lock:
                self.running.remove(r)
                self._reserved -= r._budget - len(r.block_ids)
            self._finish(r, now, r.finish_reason)

    def _finish(self, r: Request, now: float, reason: Optional[FinishReason] = None) -> None:
        r.state = RequestState.FINISHED
        r.finish_time = now
        if reason is not None:
            r.finish_reason = reason
        if not r.keep_blocks and r.block_ids:
            self.engine.pool.free(r.block_ids)
            r.block_ids = []

    def run(self, requests: Sequence[Request] = (), max_steps: Optional[int] = None) -> list[Request]:
        """Add ``requests`` and step until no work is left (or ``max_steps``); returns them."""
        for r in requests:
            self.add_request(r)
        steps = 0
        while self.has_work and (max_steps is None or steps < max_steps):
            if not self.step() and not self.running:
                raise PoolError("scheduler stalled: queued requests do not fit in the free blocks",
                                hint="free blocks held outside the scheduler or enlarge the pool")
            steps += 1
        return list(requests)
