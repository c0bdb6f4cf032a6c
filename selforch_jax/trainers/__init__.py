"""Trainers: SFT (this package's base); later DPO/IPO, GRPO, AR-diffusion, distillation, SOL."""
