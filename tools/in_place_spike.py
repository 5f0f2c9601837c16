"""Spike for in-place recovery where the survivors keep their training loop (issue 24's next
step; not used by the library). Plain torch.distributed, no unbroken:

    SPIKE_WORLD=2 python tools/in_place_spike.py     # exits 0 when the run ends bit for bit

1. A DDP comm hook catches the failed all-reduce of a dead peer: backward() returns, and
   nothing is raised in the loop.
2. The optimizer step of that void iteration is skipped.
3. The survivors join a new process group (a new store prefix) with a replacement rank, and
   re-initialise their DDP wrapper in place (`DDP.__init__` on the same object, so the
   loop's reference to it stays good); the replacement builds a fresh wrapper.
4. Rank 0 sends the state of the last complete step; the void step is redone.
5. The final weights are compared with an uninterrupted run's.

Measured on a 2-core machine (0.26 MiB model): the hook sees the failure at once; the
survivor's recovery takes 2.0 s, nearly all of it waiting for the replacement (a spawned
process importing torch). 2 ranks: bit for bit. 3 ranks: the ranks agree with each other
but not with the uninterrupted run in the last bits: DDP's first step after a new wrapper
sums the gradients in another order than the steps after it, as after any resume with 3
ranks or more (docs/exact-resume.md).
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, DIE_AT, SIZE = 8, 4, int(os.environ.get("SPIKE_SIZE", "256"))
WORLD = int(os.environ.get("SPIKE_WORLD", "3"))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, SIZE, generator=g), torch.randn(32, 1, generator=g)


class Void:
    flag = False


def hook(state, bucket):
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

    def done(f):
        try:
            return f.value()[0] / WORLD
        except Exception as e:  # noqa: BLE001
            Void.flag = True
            Void.error = str(e)[:120]
            return bucket.buffer()
    return fut.then(done)


def build(rank, store, gen):
    dist.init_process_group("gloo", store=dist.PrefixStore(f"g{gen}", store), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(SIZE, SIZE), torch.nn.ReLU(), torch.nn.Linear(SIZE, 1))
    model = DDP(module)
    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def snapshot(model, opt):
    params = {k: v.clone() for k, v in model.module.state_dict().items()}
    moms = {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}
    return params, moms


def worker(rank, store_port, replacement, out_q, die):
    store = dist.TCPStore("127.0.0.1", store_port, WORLD + 1, is_master=False)
    gen = 1 if replacement else 0
    model, opt = build(rank, store, gen)
    step = 1
    if replacement:
        k = int(store.get("resume_at").decode())
        t0 = time.perf_counter()
        recv_state(model, opt)
        step = k + 1
        out_q.put(("replacement_ready", rank, time.perf_counter() - t0))
    last_good = snapshot(model, opt)
    while step <= STEPS:
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if die and rank == WORLD - 1 and step == DIE_AT and not replacement:
            os._exit(9)  # dies after its forward, before the all-reduce
        loss.backward()
        if Void.flag:
            t0 = time.perf_counter()
            opt.zero_grad()
            # Recovery in the loop: drop the old group, join generation 1, re-init DDP in place.
            store.set(f"survivor{rank}", "1")
            dist.destroy_process_group()
            if rank == 0:
                store.set("resume_at", str(step - 1))
                store.set("need_replacement", "1")
            dist.init_process_group("gloo", store=dist.PrefixStore("g1", store), rank=rank, world_size=WORLD,
                                    timeout=datetime.timedelta(seconds=30))
            t1 = time.perf_counter()
            DDP.__init__(model, model.module)  # in place: new reducer, default buckets, broadcast
            model.register_comm_hook(None, hook)
            t2 = time.perf_counter()
            params, moms = last_good
            model.module.load_state_dict(params)
            for i, p in enumerate(opt.param_groups[0]["params"]):
                if i in moms:
                    opt.state[p]["momentum_buffer"].copy_(moms[i])
            send_state(model, opt)
            Void.flag = False
            out_q.put(("survivor_recovered", rank, {"rejoin_s": t1 - t0, "rewrap_s": t2 - t1,
                                                    "total_s": time.perf_counter() - t0}))
            continue  # redo `step`
        opt.step()
        opt.zero_grad()
        last_good = snapshot(model, opt)
        step += 1
    out_q.put(("final", rank, {k: v.clone().numpy() for k, v in model.module.state_dict().items()}))
    dist.destroy_process_group()


def send_state(model, opt):
    for t in list(model.module.state_dict().values()) + [opt.state[p]["momentum_buffer"]
                                                         for p in opt.param_groups[0]["params"]]:
        dist.broadcast(t, src=0)


def recv_state(model, opt):
    # the replacement takes one zero step so that its momentum buffers exist
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.param_groups[0]["lr"] = lr
    opt.zero_grad()
    send_state(model, opt)


def run(die):
    port = 29000 + (7 if die else 3)
    master = dist.TCPStore("127.0.0.1", port, WORLD + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, False, q, die)) for r in range(WORLD)]
    for p in procs:
        p.start()
    if die:
        master.wait(["need_replacement"], datetime.timedelta(seconds=60))
        rep = ctx.Process(target=worker, args=(WORLD - 1, port, True, q, die))
        rep.start()
        procs.append(rep)
    finals, events = {}, []
    while len(finals) < WORLD:
        kind, rank, value = q.get(timeout=120)
        if kind == "final":
            finals[rank] = value
        else:
            events.append((kind, rank, value))
    for p in procs:
        p.join()
    return finals, events


if __name__ == "__main__":
    ref, _ = run(False)
    got, events = run(True)
    for e in events:
        print(e)
    import numpy as np
    same = all(np.array_equal(ref[0][k], got[r][k]) for r in range(WORLD) for k in ref[0])
    print("BIT FOR BIT:", same, "ranks agree:", all(np.array_equal(got[0][k], got[r][k]) for r in range(WORLD)
                                                     for k in got[0]))
    sys.exit(0 if same else 1)
