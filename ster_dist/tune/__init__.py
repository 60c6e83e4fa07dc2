"""LoRA adapter training across ranks (`ster tune sft`, preference tuning with `ster tune dpo`,
reward models with `ster tune reward`, GRPO with `ster tune grpo`) and completion-token evaluation
(`ster tune evaluate`).

spec.py      the run's settings and every refusal that needs only the config and the arguments
data.py      examples -> token ids through the chat template as generation applies it, a
completion-only
             loss mask, and the seeded order of optimizer steps
lora.py      trainable factors on the decoder's column- and row-parallel projections (the runtime
             adapter mechanism of parallel/linear.py and adapters/attach.py, with nn.Parameters)
parallel.py  the dp x tp layout: subgroups, the training ParallelCtx whose collectives carry
gradients,
             and the model-parallel view DeepSpeed asks for
loss.py      summed negative log-likelihood over completion tokens
objective.py what a run minimises (units, collation, loss, report, an optional head); sft's own
pairs.py     preference pairs (prompt, chosen, rejected) as token ids, refused by line, never cut
preference.py  DPO and IPO against the adapters-skipped reference, and the Bradley-Terry reward head
rollout.py   grpo's prompts, the groups of completions sampled on the rank from the policy (drawn as
the
             token engine draws), their rewards (length, or a `tune reward` model)
engine_rollouts.py  grpo's groups and conversations sampled by the token engine on its own ranks
             (--rollout engine), the factors pushed to it as a per-request adapter before every step
conversation.py  multi-turn grpo: conversations between the policy and a user model, each side's
turns
             drawn wherever its Draw draws them; the user's turns masked out of the loss
grpo.py      GRPO: group-relative advantages, the on-policy ratio and a k3 KL against the
adapters-skipped
             reference
prepare.py   the driver's half before any rank starts: resolve, refuse, plan sites, tokenize
train.py     the DeepSpeed engine on every rank (ZeRO 1/2, accumulation, bf16/f32) and the driver
loop
writer.py    the trained factors as a PEFT adapter directory (with Ster's sidecar fields); a reward
             model's head as PEFT's sequence-classification `score`
evaluate.py  loss and perplexity over completion tokens, with or without an adapter
"""
