"""A patched model under DDP and FSDP2 (2 processes), and codetta.nn.Decoder under FSDP2, give the
loss and gradients of one process.

On a machine with two GPUs or more, each rank runs on its own GPU (NCCL, compiled kernels);
elsewhere on the CPU (gloo, Triton's interpreter). Each rank runs half of the batch; the
single-process reference runs the whole batch.
With the same number of counted tokens per rank, the mean of the ranks' losses is the
whole batch's loss and the averaged gradients are its gradients.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import codetta
from conftest import DEVICE

transformers = pytest.importorskip("transformers")

BATCH, SEQ, VOCAB = 4, 10, 64
WORLD = 2
ON_GPUS = DEVICE == "cuda" and torch.cuda.device_count() >= WORLD


def tiny_model(kind):
    torch.manual_seed(0)
    if kind == "decoder":
        return codetta.nn.Decoder(codetta.nn.DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      attn_implementation="sdpa")
    return codetta.patch(transformers.LlamaForCausalLM(config).float())


def batch():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def loss_of(kind, model, ids):
    """The mean next-token loss of ids, the same number of tokens counted in every row."""
    if kind == "decoder":
        targets = torch.roll(ids, -1, 1)
        targets[:, -1] = -100
        return model(ids, targets)
    return model(input_ids=ids, labels=ids).loss


def _worker(rank, world, kind, mode, init_file, out_file):
    device = torch.device("cuda", rank) if ON_GPUS else torch.device("cpu")
    if ON_GPUS:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if ON_GPUS else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        model = tiny_model(kind).to(device)
        if mode == "fsdp2-checkpointed":  # transformers' own activation checkpointing, inside each sharded layer
            model.gradient_checkpointing_enable()
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if ON_GPUS else None)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (world,))
            # "fsdp2-ahead": the layers stay gathered after a forward, and a patched model's layers are
            # each in a checkpoint wrapper, the unit FSDP2 shards (no hooks of its own on the layer)
            ahead = mode == "fsdp2-ahead"
            if ahead and kind == "hf":
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

                layer_class = type(model.model.layers[0])
                apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, layer_class))
            for layer in model.layers if kind == "decoder" else model.model.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=not ahead)  # each layer, then the root
            wrapped = fully_shard(model, mesh=mesh, reshard_after_forward=not ahead)
        ids = batch().chunk(world)[rank].to(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "fsdp2-ahead":
                with torch.no_grad():  # a validation forward: every layer is gathered when the training one runs
                    loss_of(kind, wrapped, ids)
            loss = loss_of(kind, wrapped, ids)
            loss.backward()
        losses = [torch.zeros((), device=device) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor
                g = g.full_tensor()
            grads[name.replace("._checkpoint_wrapped_module", "")] = g.detach().cpu()  # the wrapper's name left out
        if rank == 0:
            torch.save({"loss": torch.stack(losses).mean().cpu(), "grads": grads,
                        "codetta_warnings": [str(w.message) for w in caught if "codetta" in str(w.message)]}, out_file)
    finally:
        dist.barrier()  # no rank tears the group down while the other still has collectives in flight
        dist.destroy_process_group()
    # done: leave without the interpreter's teardown, where gloo's threads were seen to abort a
    # rank at times after FSDP2 kept its layers gathered ("terminate called without an active
    # exception"), the results already written
    os._exit(0)


@pytest.mark.skipif(DEVICE == "cuda" and not ON_GPUS, reason="a machine with one GPU: the ranks would need the CPU "
                    "and Triton's interpreter, which the GPU image's Triton 3.6 + numpy 2.5 cannot run")
@pytest.mark.parametrize("kind, mode", [("hf", "ddp"), ("hf", "fsdp2"), ("hf", "fsdp2-ahead"),
                                        ("hf", "fsdp2-checkpointed"), ("decoder", "fsdp2-ahead")])
def test_two_processes_match_one(kind, mode, tmp_path):
    """Under FSDP2 a layer's next layer is sharded while it runs, or gathered ahead (found by
    probes: the Decoder handed its DTensor norm weight to the MLP's operator, which failed; with
    the next layer gathered ahead, its input norm's statistics made by this layer gave that
    norm's weight a wrong gradient, or none, and the Decoder refused the statistics). The
    "fsdp2-ahead" Decoder's first, no-grad forward meets its layers sharded. The layers stay fused (no
    codetta warning of a layer run as the model's own code): FSDP2's FSDP<Layer> subclass has, from
    transformers 5.23, a forward of its own, transformers' checkpointing wrapper of the layer's
    (found by a probe: every layer sharded by fully_shard ran unfused)."""
    init_file, out_file = tmp_path / "init", tmp_path / "out.pt"
    mp.spawn(_worker, args=(WORLD, kind, mode, str(init_file), str(out_file)), nprocs=WORLD, join=True)
    got = torch.load(out_file)
    assert not got["codetta_warnings"]
    model = tiny_model(kind).to(DEVICE)  # the single-process reference: compiled kernels on a GPU
    loss = loss_of(kind, model, batch().to(DEVICE))
    loss.backward()
    assert abs(got["loss"].item() - loss.item()) < 1e-5 * loss.item()
    for name, p in model.named_parameters():
        grad = p.grad.cpu()
        err = ((got["grads"][name] - grad).norm() / grad.norm()).item()
        assert err < 1e-4, f"{name}: {err}"
