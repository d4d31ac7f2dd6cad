"""Finding: after a training step in which a patched layer's next layer did not run (layers
truncated after patching, config.num_hidden_layers lowered, a layer skipped by a
stochastic-depth wrapper), the next layer's StatsHandoff slot keeps that step's residual
stream tensor (a non-leaf with its autograd graph) and its norm statistics. Then
copy.deepcopy(model) (EMA / AveragedModel / keeping the best model) raises, though the
unpatched model copies fine; torch.save(model) pickles the stale activations into the file."""
import os, copy, io
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch, transformers, codetta

cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
torch.manual_seed(0)
ref = transformers.LlamaForCausalLM(cfg)
model = codetta.patch(copy.deepcopy(ref))
ids = torch.randint(0, 64, (2, 16))
for name, m in (("unpatched", ref), ("patched", model)):
    m.model.layers = m.model.layers[:2]          # e.g. layer pruning, after patching
    m(input_ids=ids, labels=ids).loss.backward()
    try:
        copy.deepcopy(m)
        print(name, "deepcopy ok")
    except RuntimeError as e:
        print(name, "deepcopy RuntimeError:", str(e)[:100])
    buf = io.BytesIO(); torch.save(m, buf)
    print(name, "torch.save bytes", buf.tell())
# expected: both copy fine, same-sized checkpoints
