"""LoRA adapter training across ranks (`ster tune sft`) and completion-token evaluation (`ster tune evaluate`).

spec.py      the run's settings and every refusal that needs only the config and the arguments
data.py      examples -> token ids through the chat template as generation applies it, a completion-only
             loss mask, and the seeded order of optimizer steps
lora.py      trainable factors on the decoder's column- and row-parallel projections (the runtime
             adapter mechanism of parallel/linear.py and adapters/attach.py, with nn.Parameters)
parallel.py  the dp x tp layout: subgroups, the training ParallelCtx whose collectives carry gradients,
             and the model-parallel view DeepSpeed asks for
loss.py      summed negative log-likelihood over completion tokens
train.py     the DeepSpeed engine on every rank (ZeRO 1/2, accumulation, bf16/f32) and the driver loop
writer.py    the trained factors as a PEFT adapter directory (with Ster's sidecar fields)
evaluate.py  loss and perplexity over completion tokens, with or without an adapter
"""
