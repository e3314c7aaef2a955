"""Continuous batching with NEO's CPU offload: which requests run this iteration, where, and how.

Three queues: `waiting` (prefill), `running` (KV on the device: prefill chunks and GPU decodes) and
`cpu_running` (KV in the host pool: CPU decodes). Every iteration:
1. swap-in (policy auto): CPU-requests return to the device while it has room and nothing waits;
2. room for admission: when the next prompt does not fit on the device, the newest GPU decodes are swapped
   out to the host pool (never a request swapped in this iteration);
3. running GPU requests get their tokens; on a shortage the newest is swapped out, or preempted by
   recompute when the host pool cannot take it (or the policy is `never`);
4. CPU-requests grow in the host pool (preempted by recompute on a shortage);
5. waiting prompts are admitted within the token budget and `max_num_seqs`, each once the device has room for
   all of it (a prompt longer than the budget prefills in chunks over several iterations); a finished prefill
   is moved to the host pool after the step when the policy is `always`, or under `auto` when the device is
   nearly full or prompts wait for its memory (and the move pays);
6. the performance model picks the CPU decodes that fit the latency bound (auto: the GPU part's predicted
   time times `cpu_latency_slack`) and the mode, sequential or the two-sub-batch pipeline, by predicted tokens/s.
Under `auto` a request moves to the host only where the model predicts more tokens/s with it there (NEO's
objective) within the latency bound; otherwise the next prompt waits, or the request is preempted by recompute.
While prompts wait for device memory, the host is judged by the batch it will hold once they have followed the
request there. CPU-requests that find no room to return to the device all run in every iteration: left out, they
would only wait longer.

The scheduler moves no data: its plan (`SchedulerOutput`) lists the swaps, which the model runner carries out
before the step. A swap-out started after a step (a finished prefill going to the host) is in flight until the
runner reports it landed (`swaps_landed`): only then are its device blocks free and may the request decode.
"""

from __future__ import annotations

from collections import deque

from ..config import EngineConfig
from .block_manager import BlockManager
from .perf_model import PerfModel
from .scheduler_output import SchedulerOutput, SwapIn, SwapOut
from .sequence import Placement, Sequence, SequenceStatus

MAX_SKIPPED_ITERATIONS = 4  # auto: a CPU-request left out this many iterations in a row runs regardless
GPU_WATERMARK = 0.05  # auto: keep this fraction of device blocks free before offloading new requests
CPU_BEHIND = 1.5  # auto: measured/predicted host time above this stops new offloads
HOST_SLOW = 3.0  # auto: host attention this much slower than profiled sends CPU-requests back


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        policy: str,
        gpu_blocks: BlockManager,
        cpu_blocks: BlockManager,
        perf: PerfModel | None,
    ) -> None:
        """`policy`: the offload policy this engine can serve (`never` without a host pool); `perf`: None under
        `never`."""
        self.config = config
        self.policy = policy
        self.gpu_blocks, self.cpu_blocks = gpu_blocks, cpu_blocks
        self.perf = perf
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cpu_running: list[Sequence] = []
        self._swaps_in_flight: dict[str, list[int]] = {}  # request id -> device blocks freed once it lands
        self._swapped_in: set[str] = set()
        self._stranded = False  # CPU-requests found no room on the device this iteration
        self._skipped: dict[str, int] = {}
        self.preemptions: dict[str, int] = {}  # by cause (`_preempt`)
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    @property
    def cpu_behind(self) -> bool:
        """The fail-safe's signal: CPU work runs much slower than predicted, so `auto` stops giving it more."""
        return self.perf is not None and max(self.perf.cpu_correction, self.perf.offload_slowdown) > CPU_BEHIND

    @property
    def host_slow(self) -> bool:
        """The host's attention itself runs far slower than profiled: other processes hold its cores."""
        return self.perf is not None and self.perf.cpu_correction > HOST_SLOW

    @property
    def host_in_use(self) -> bool:
        """Requests live on the host or are on their way there, or the next iteration may send some (prompts wait
        for device memory under an offloading policy): the engine then schedules on every token read back."""
        if self.cpu_running or self._swaps_in_flight:
            return True
        return self.policy != "never" and self._prompts_wait_for_memory()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and return its blocks. A swap-out of it in flight must have
        landed first (`is_swapping_out`): its copy would write host blocks that are no longer its own."""
        self._skipped.pop(seq.request_id, None)
        for queue in (self.running, self.cpu_running, self.waiting):
            if seq in queue:
                queue.remove(seq)
                break
        self._pool(seq).free(seq)

    def disable_offload(self) -> None:
        """Fail-over after a CPU kernel error: no more offloading; CPU-requests are recomputed on the GPU. Every
        swap-out in flight must have landed first."""
        self.policy = "never"
        self._recompute_cpu_requests(SchedulerOutput(), "cpu_kernel_failed")

    def swaps_landed(self, request_ids: list[str]) -> None:
        """The runner's report: these swap-outs have landed in the host pool, so their device blocks are free and
        their requests may decode on the CPU."""
        for request_id in request_ids:
            self.gpu_blocks.release(self._swaps_in_flight.pop(request_id))

    def is_swapping_out(self, seq: Sequence) -> bool:
        """A request whose swap-out to the host pool is still copying: it cannot decode or move yet."""
        return seq.request_id in self._swaps_in_flight

    def schedule(self) -> SchedulerOutput:
        self._swapped_in.clear()
        self._stranded = False
        out = SchedulerOutput()
        if self.policy == "auto" and (not self.waiting or self.cpu_behind):
            self._swap_in(out)
        if self.policy == "auto" and self.host_slow:
            self._recompute_cpu_requests(out, "host_slow")
        if self.policy != "never":
            self._make_room_for_admission(out)
        budget = self._schedule_gpu_running(out, self.config.max_num_batched_tokens)
        cpu_ready = self._grow_cpu_running(out)
        if not out.preempted:
            self._admit(out, budget)
        if self.perf is not None:
            out.predicted_time = self.perf.sequential(*out.gpu_work(), 0, 0)
        self._plan_cpu_decodes(out, cpu_ready)
        self._place_finished_prefills(out)
        return out

    def offload(self, seqs: list[Sequence]) -> list[SwapOut]:
        """Move freshly prefilled requests to the host pool after the step that prefilled them; returns the
        swap-outs for the runner to start, in flight until it reports them landed."""
        swaps = []
        for seq in seqs:
            if not seq.finished and seq in self.running:
                swap = self._swap_out(seq)
                if swap is not None:
                    swaps.append(swap)
        return swaps

    # Steps ------------------------------------------------------------------------------------------------

    def _swap_in(self, out: SchedulerOutput) -> None:
        """Bring CPU-requests back while the device keeps headroom: the watermark, and one block of growth
        per GPU request (so the next shortage does not swap the same request straight out again)."""
        for seq in list(self.cpu_running):
            if self.is_swapping_out(seq):
                continue
            reserve = max(int(GPU_WATERMARK * self.gpu_blocks.num_blocks), len(self.running) + 1)
            need = self.gpu_blocks.blocks_needed(len(seq.token_ids) + 1)
            if len(self.running) + 1 > self.config.max_num_seqs or need + reserve > self.gpu_blocks.num_free_blocks:
                self._stranded = True
                return
            gpu = self.gpu_blocks.allocate(len(seq.block_table))
            out.swap_in.append(SwapIn(seq.block_table, list(gpu)))  # a copy: the table grows before the swap runs
            self.swap_in_blocks += len(gpu)
            self.cpu_blocks.release(seq.block_table)
            seq.block_table = gpu
            seq.placement = Placement.GPU
            self.cpu_running.remove(seq)
            self.running.append(seq)
            self._swapped_in.add(seq.request_id)

    def _recompute_cpu_requests(self, out: SchedulerOutput, cause: str) -> None:
        """Every CPU-request leaves the host pool, to be recomputed on the GPU: after a kernel failure, or on a
        busy host for those that found no room to swap back (left there, each would stall every iteration it
        is forced into, MAX_SKIPPED_ITERATIONS)."""
        for seq in list(reversed(self.cpu_running)):
            self._preempt(seq, out, cause)

    def _make_room_for_admission(self, out: SchedulerOutput) -> None:
        while self._prompts_wait_for_memory():
            victim = self._newest_swappable()
            if victim is None or self._swap_out_now(victim, out):
                return

    def _schedule_gpu_running(self, out: SchedulerOutput, budget: int) -> int:
        idx = 0
        while idx < len(self.running) and budget > 0:
            seq = self.running[idx]
            if seq.finishing:
                idx += 1
                continue
            n = 1 if seq.is_decode else min(seq.num_uncomputed_tokens, budget)
            if not self._grow_on_gpu(seq, seq.num_computed_tokens + n, out):
                continue  # seq left the running queue; the same idx now holds the next one
            (out.gpu_decodes.append(seq) if seq.is_decode else out.prefills.append((seq, n)))
            budget -= n
            idx += 1
        return budget

    def _grow_on_gpu(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `seq` room for `num_tokens`, evicting the newest running requests (swap-out or recompute)."""
        while not self.gpu_blocks.can_grow(seq, num_tokens):
            victim = self.running[-1]
            if not victim.is_decode:
                self._preempt(victim, out, "device_full_prefill")
            elif victim.request_id in self._swapped_in:
                self._preempt(victim, out, "device_full_swapped_in")
            elif refusal := self._swap_out_now(victim, out):
                self._preempt(victim, out, refusal)
            if victim is seq:
                return False
        self.gpu_blocks.grow(seq, num_tokens)
        return True

    def _grow_cpu_running(self, out: SchedulerOutput) -> list[Sequence]:
        ready = []
        for seq in list(self.cpu_running):
            if seq not in self.cpu_running or self.is_swapping_out(seq) or seq.finishing:
                continue  # preempted below to make room for an older one, still copying to the host, or done
            while not self.cpu_blocks.can_grow(seq, len(seq.token_ids)):
                victim = self.cpu_running[-1]
                self._preempt(victim, out, "host_full")
                if victim is seq:
                    break
            if seq in self.cpu_running:
                self.cpu_blocks.grow(seq, len(seq.token_ids))
                ready.append(seq)
        return ready

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting prompts while the token budget lasts and the device has room for each whole prompt
        besides what the prompts already admitted still need: a prompt admitted for its first chunk only would be
        preempted once the device fills, every chunk of it recomputed."""
        owed = self._prefill_blocks_owed()
        while self.waiting and budget > 0 and len(self.running) + len(self.cpu_running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._prompt_fits(seq, owed):
                break
            self.waiting.popleft()
            self.gpu_blocks.grow(seq, n)
            owed += self._blocks_to_finish_prefill(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append((seq, n))
            budget -= n

    def _plan_cpu_decodes(self, out: SchedulerOutput, ready: list[Sequence]) -> None:
        """Choose the CPU decodes of this iteration and the mode, by the performance model.

        Under `auto`, CPU work may stretch the iteration to at most `cpu_latency_slack` times what its GPU part alone
        is predicted to take, unless the CPU-requests found no room to return to the device (on a host that keeps
        up); CPU-requests left out MAX_SKIPPED_ITERATIONS times in a row run regardless, so none starves. Left-out
        requests go first next time.
        """
        if not ready:
            return
        gpu_tokens, gpu_ctx = out.gpu_work()
        gpu_alone = self.perf.sequential(gpu_tokens, gpu_ctx, 0, 0)
        bounded = self.policy == "auto" and gpu_tokens and (self.cpu_behind or not self._stranded)
        bound = gpu_alone * self.config.cpu_latency_slack if bounded else float("inf")
        ready = sorted(ready, key=lambda s: -self._skipped.get(s.request_id, 0))
        forced = sum(1 for s in ready if self._skipped.get(s.request_id, 0) >= MAX_SKIPPED_ITERATIONS)
        ctx = [len(s.token_ids) for s in ready]
        count, (predicted, pipelined, split) = forced, self.best_mode(gpu_tokens, gpu_ctx, ctx[:forced])
        for n in range(len(ready), forced, -1):
            plan = self.best_mode(gpu_tokens, gpu_ctx, ctx[:n])
            if plan[0] <= bound:
                count, (predicted, pipelined, split) = n, plan
                break
        out.cpu_decodes = ready[:count]
        out.pipelined, out.split = pipelined, split
        out.predicted_time = predicted if count else gpu_alone
        out.predicted_cpu_time = self.perf.cpu_attention(count, sum(ctx[:count]))
        for seq in ready:
            self._skipped[seq.request_id] = 0 if seq in out.cpu_decodes else self._skipped.get(seq.request_id, 0) + 1

    def best_mode(self, gpu_tokens: int, gpu_ctx: int, ctx: list[int]) -> tuple[float, bool, int]:
        """(predicted time, pipelined?, split) with the best tokens/s for these CPU decodes."""
        time, pipelined, split = self._best_mode_uncorrected(gpu_tokens, gpu_ctx, ctx)
        return self.perf.corrected(time, bool(ctx)), pipelined, split

    def _best_mode_uncorrected(self, gpu_tokens: int, gpu_ctx: int, ctx: list[int]) -> tuple[float, bool, int]:
        n = len(ctx)
        sequential = self.perf.sequential(gpu_tokens, gpu_ctx, n, sum(ctx))
        if self.config.pipeline == "off" or n < 2:
            return sequential, False, 0
        best_pipe, best_split = float("inf"), 0
        prefix = [0]
        for c in ctx:
            prefix.append(prefix[-1] + c)
        for split in range(n + 1):
            t = self.perf.pipelined(gpu_tokens, gpu_ctx, (split, prefix[split]), (n - split, prefix[n] - prefix[split]))
            if t < best_pipe:
                best_pipe, best_split = t, split
        if best_split == n:  # nothing in sub-batch 1: that is the sequential mode
            return sequential, False, 0
        if self.config.pipeline == "on" or best_pipe < sequential:
            return best_pipe, True, best_split
        return sequential, False, 0

    def _place_finished_prefills(self, out: SchedulerOutput) -> None:
        if self.policy == "never":
            return
        reserve = int(GPU_WATERMARK * self.gpu_blocks.num_blocks)
        short = self.gpu_blocks.num_free_blocks < reserve or self._prompts_wait_for_memory()
        for seq, n in out.prefills:
            if seq.num_computed_tokens + n != len(seq.token_ids):
                continue
            if self.policy == "always" or short:
                out.offload_after_step.append(seq)

    # Movement ---------------------------------------------------------------------------------------------

    def _newest_swappable(self) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.is_decode and not seq.finishing and seq.request_id not in self._swapped_in:
                return seq
        return None

    def _swap_out_refusal(self, seq: Sequence) -> str | None:
        """Why `seq` cannot move to the host pool (the cause of its preemption, where it must leave the device),
        or None."""
        if self.policy == "never":
            return "device_full_no_host"
        if self.cpu_blocks.num_free_blocks < len(seq.block_table) + 1:
            return "device_full_host_full"
        if self.policy == "auto" and not self._cpu_can_take(seq):
            return "device_full_host_would_not_pay"
        return None

    def _swap_out(self, seq: Sequence) -> SwapOut | None:
        """Move `seq` to the host pool, its swap-out in flight; None if `_swap_out_refusal` refuses it."""
        return None if self._swap_out_refusal(seq) is not None else self._move_to_host(seq)

    def _move_to_host(self, seq: Sequence) -> SwapOut:
        cpu = self.cpu_blocks.allocate(len(seq.block_table))
        swap = SwapOut(seq.request_id, seq.block_table, list(cpu))  # a copy: the table grows before the swap runs
        self._swaps_in_flight[seq.request_id] = seq.block_table
        self.swap_out_blocks += len(cpu)
        seq.block_table = cpu
        seq.placement = Placement.CPU
        self.running.remove(seq)
        self.cpu_running.append(seq)
        return swap

    def _swap_out_now(self, seq: Sequence, out: SchedulerOutput) -> str | None:
        """Swap `seq` out for its device blocks, which this step reuses: the runner lands it (and every swap-out
        in flight before it) at once. Returns why it could not move, or None once it has."""
        refusal = self._swap_out_refusal(seq)
        if refusal is not None:
            return refusal
        out.swap_out.append(self._move_to_host(seq))
        self._land_swap_outs()
        return None

    def _land_swap_outs(self) -> None:
        """Every swap-out in flight lands (the runner waits for it): its device blocks are free."""
        self.swaps_landed(list(self._swaps_in_flight))

    def _cpu_can_take(self, seq: Sequence) -> bool:
        """Whether moving `seq` to the host pays, by NEO's objective: beside the device's decodes, an iteration with
        the host's decodes (`seq` among them) must fit the latency bound and yield more tokens/s than the device's
        decodes alone. Otherwise `seq` is better recomputed later: starved on a slow host, or slowing every device
        decode more than its own tokens add (a fast GPU beside a host of little memory bandwidth). While prompts
        wait for device memory, the host's batch is judged as it will be once as many of them as the bound allows
        have followed `seq` there, beside as many device decodes as now (a prompt takes the room `seq` leaves): a
        host whose fixed cost only a larger batch repays is used, and a long queue does not stop offloading."""
        if self.perf is None:
            return True
        if self.cpu_behind:
            return False
        cpu_ctx = [len(s.token_ids) for s in self.cpu_running + [seq]]
        followers: list[int] = []
        if self._prompts_wait_for_memory():
            gpu = self.running
            followers = [len(s.token_ids) for s in self._followers(seq)]
        else:
            gpu = [s for s in self.running if s is not seq]
        gpu_tokens, gpu_ctx = len(gpu), sum(len(s.token_ids) for s in gpu)
        alone = self.perf.sequential(gpu_tokens, gpu_ctx, 0, 0)
        bound = alone * self.config.cpu_latency_slack
        with_cpu = self.best_mode(gpu_tokens, gpu_ctx, cpu_ctx)[0]
        if with_cpu > bound:
            return False
        low, high = 0, len(followers)  # the iteration's time only grows with its host batch: bisect the count
        while low < high:
            count = (low + high + 1) // 2
            predicted = self.best_mode(gpu_tokens, gpu_ctx, cpu_ctx + followers[:count])[0]
            if predicted <= bound:
                low, with_cpu = count, predicted
            else:
                high = count - 1
        return (gpu_tokens + len(cpu_ctx) + low) * alone >= gpu_tokens * with_cpu

    def _prompts_wait_for_memory(self) -> bool:
        """The next prompt does not fit in the free device blocks beside what the admitted prompts still need."""
        return bool(self.waiting) and not self._prompt_fits(self.waiting[0], self._prefill_blocks_owed())

    def _prompt_fits(self, seq: Sequence, owed: int) -> bool:
        """All of `seq`'s prompt fits in the free device blocks beside `owed` blocks promised to admitted prompts."""
        return self._blocks_to_finish_prefill(seq) + owed <= self.gpu_blocks.num_free_blocks

    def _prefill_blocks_owed(self) -> int:
        """Device blocks the admitted prompts still need to finish their prefill (chunked by the token budget)."""
        return sum(self._blocks_to_finish_prefill(s) for s in self.running if not s.is_decode)

    def _blocks_to_finish_prefill(self, seq: Sequence) -> int:
        return self.gpu_blocks.extra_blocks_for(seq, len(seq.token_ids))

    def _followers(self, seq: Sequence) -> list[Sequence]:
        """The waiting prompts that would follow `seq` to the host: in order, while the host pool and
        `max_num_seqs` have room for them."""
        free = self.cpu_blocks.num_free_blocks - len(seq.block_table) - 1
        slots = self.config.max_num_seqs - len(self.running) - len(self.cpu_running)
        followers = []
        for waiting in self.waiting:
            need = self.cpu_blocks.blocks_needed(len(waiting.token_ids) + 1)
            if len(followers) == slots or need > free:
                break
            followers.append(waiting)
            free -= need
        return followers

    def _preempt(self, seq: Sequence, out: SchedulerOutput, cause: str) -> None:
        if self.is_swapping_out(seq):  # its host blocks are freed below: the copy into them lands first
            self._land_swap_outs()
            out.land_swap_outs = True
        (self.running if seq in self.running else self.cpu_running).remove(seq)
        self._pool(seq).free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.preemptions[cause] = self.preemptions.get(cause, 0) + 1

    def _pool(self, seq: Sequence) -> BlockManager:
        return self.cpu_blocks if seq.placement == Placement.CPU else self.gpu_blocks
