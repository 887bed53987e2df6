"""Child process of ``test_sglang_backend.test_real_prefill_bootstrap_queue``: SGLang's own
``PrefillBootstrapQueue`` (with its ``MHATokenToKVPool``, ``MetadataBuffers``, metadata index
allocator and ``Req`` objects) drives the kvbridge backend; the decode side is the backend's
receiver over a second SGLang pool. Runs in its own process because SGLang publishes
process-wide configuration and this needs a (one-rank) torch.distributed group.

Prints one JSON line with what happened. Usage: ``python _sglang_queue_child.py MODEL_DIR LISTEN``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import types
from array import array

if os.environ.get("KVBRIDGE_SGLANG_STUBS"):
    sys.path.insert(0, os.environ["KVBRIDGE_SGLANG_STUBS"])

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(model_dir: str, listen: str) -> dict[str, object]:
    os.environ["KVBRIDGE_SGLANG_LISTEN"] = listen
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation import utils as du
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    page, layers, heads, dim = 4, 2, 2, 64
    sa = ServerArgs(model_path=model_dir, device="cpu", disaggregation_mode="prefill",
                    disaggregation_transfer_backend="kvbridge", page_size=page, skip_server_warmup=True)
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, gpu_id=0))
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    world = dist.group.WORLD

    backend = du.TransferBackend("kvbridge")
    boot = du.get_kv_class(backend, du.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", 0)

    def kv_pool() -> MHATokenToKVPool:
        return MHATokenToKVPool(size=256, page_size=page, dtype=torch.float32, head_num=heads, head_dim=dim,
                                layer_num=layers, device="cpu", enable_memory_saver=False)

    def meta() -> du.MetadataBuffers:
        return du.MetadataBuffers(16, hidden_size=heads * dim, hidden_states_dtype=torch.float32,
                                  max_sampling_mask_tokens=0)

    p_pool, p_meta = kv_pool(), meta()
    failures: list[object] = []
    scheduler = types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(
            effective_logical_max_total_num_tokens=256, kv_cache_dtype_str="torch.float32")),
        kv_shard_widening=1, token_to_kv_pool_allocator=types.SimpleNamespace(page_size=page), rust_server=None,
        model_config=types.SimpleNamespace(hf_text_config=AutoConfig.from_pretrained(model_dir),
                                           num_hidden_layers=layers, get_total_num_kv_heads=lambda: heads),
        server_args=sa, attn_cp_cpu_group=world, attn_tp_cpu_group=world, processed_tokens_counter=0,
        handle_bootstrap_failure=lambda req: failures.append(req.rid))
    queue = PrefillBootstrapQueue(p_pool, None, du.ReqToMetadataIdxAllocator(16), p_meta, gpu_id=0,
                                  bootstrap_port=boot.mailbox.port, max_total_num_tokens=256, scheduler=scheduler,
                                  scheduler_stage_metrics=None, transfer_backend=backend)

    # decode rank: a second SGLang pool and metadata buffers, described by SGLang's own helpers
    d_pool, d_meta = kv_pool(), meta()
    d_args = KVArgs()
    d_args.kv_data_ptrs, d_args.kv_data_lens, d_args.kv_item_lens = du.get_kv_transfer_buf_infos(d_pool)
    d_args.aux_data_ptrs, d_args.aux_data_lens, d_args.aux_item_lens = d_meta.get_buf_infos()
    d_args.kv_head_num, d_args.page_size, d_args.engine_rank = heads, page, 0
    d_args.kv_cache_dtype_str = "torch.float32"
    d_mgr = du.get_kv_class(backend, du.KVClassType.MANAGER)(d_args, du.DisaggregationMode.DECODE, sa, False)
    rcv_cls = du.get_kv_class(backend, du.KVClassType.RECEIVER)

    g = torch.Generator().manual_seed(0)
    for buf in p_pool.k_buffer + p_pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=g))
    cases = [(101, list(range(5, 15)), [3, 4, 5], [20, 9, 31]),       # room, prompt, prefill pages, decode pages
             (102, list(range(40, 63)), [7, 8, 10, 11, 12, 13], [1, 2, 40, 41, 42, 50])]
    out: dict[str, object] = {"requests": len(cases), "polls": {}, "equal": 0, "aux_equal": 0}
    for room, prompt, src, dst in cases:
        req = Req(f"r{room}", "", array("i", prompt), SamplingParams(max_new_tokens=1),
                  bootstrap_host="127.0.0.1", bootstrap_port=boot.mailbox.port, bootstrap_room=room,
                  disagg_mode=du.DisaggregationMode.PREFILL)
        queue.add(req, num_kv_heads=heads)
        rcv = rcv_cls(d_mgr, f"127.0.0.1:{boot.mailbox.port}", room)
        rcv.init(0)
        d_idx = room % 16
        rcv.send_metadata(np.array(dst, dtype=np.int32), d_idx)
        popped: list[object] = []
        deadline = time.monotonic() + 10
        while req not in popped and time.monotonic() < deadline:
            popped += queue.pop_bootstrapped()                 # the queue's own polling
            time.sleep(0.005)
        assert req in popped, "the bootstrap queue never released the request"
        # "prefill": the first output token lands in the request's metadata slot, then the chunk is sent
        p_meta.output_ids[req.metadata_buffer_index][0] = 1000 + room
        req.disagg_kv_sender.send(np.array(src, dtype=np.int32))
        seen = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ps, rs = req.disagg_kv_sender.poll(), rcv.poll()
            if not seen or seen[-1] != (int(ps), int(rs)):
                seen.append((int(ps), int(rs)))
            if ps in (KVPoll.Success, KVPoll.Failed) and rs in (KVPoll.Success, KVPoll.Failed):
                break
            time.sleep(0.002)
        out["polls"][str(room)] = seen                              # type: ignore[index]
        same = all(torch.equal(p_pool.k_buffer[i][s * page:(s + 1) * page], d_pool.k_buffer[i][d * page:(d + 1) * page])
                   and torch.equal(p_pool.v_buffer[i][s * page:(s + 1) * page],
                                   d_pool.v_buffer[i][d * page:(d + 1) * page])
                   for i in range(layers) for s, d in zip(src, dst))
        out["equal"] = int(out["equal"]) + int(same and seen[-1] == (int(KVPoll.Success), int(KVPoll.Success)))
        out["aux_equal"] = int(out["aux_equal"]) + int(int(d_meta.output_ids[d_idx][0]) == 1000 + room)
    out["bootstrap_failures"] = len(failures)
    d_mgr.close()
    queue.kv_manager.close()
    boot.close()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
    os._exit(0)
