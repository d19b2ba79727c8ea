"""Plug-ins that put qattn under other libraries' attention calls; docs/integrations.md
says what each covers and what falls back.

    import qattn.integrations.transformers as qattn_tf
    qattn_tf.register()                               # attn_implementation="qattn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="qattn")

    import qattn.integrations.diffusers as qattn_df
    qattn_df.apply(pipe)                              # every attention of the pipeline

Each submodule imports its library when it is used, not when it is imported, so qattn
never requires transformers or diffusers. Every call goes through
qattn.scaled_dot_product_attention, so what qattn does not run (see qattn.sdpa: e.g.
dropout, a head dim above 128, a CPU tensor) runs on PyTorch's SDPA with a
QattnFallbackWarning once per reason, or raises under qattn.set_fallback("raise").
"""

__all__ = ["diffusers", "transformers"]
