"""Short LightningModules around other people's models, trained with lmledger's data and ledger.

    hf_lm.LlamaLM, hf_lm.GPT2LM   Hugging Face transformers' LlamaForCausalLM / GPT2LMHeadModel, tiny,
                                  built from a config object (no download); needs `pip install .[hf]`
    byte_convnet.ByteConvNet      a causal 1-D convolutional net over bytes: no attention, no transformers
    _common.TokenWindowModule     what they share: the (inputs, targets) loss logging and AdamW's decay groups

Each has a config under configs/examples/; `lmledger fit --config configs/examples/X.yaml` (from the
repository root) trains it on the prepared stdlib corpus. docs/any-model.md has the details.
"""
