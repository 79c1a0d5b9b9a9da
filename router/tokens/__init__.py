"""From a request body to token ids, exactly as the replica will compute them: body parsing and
limits, prompts of every endpoint, chat rendering, the local and remote tokenizers, and the
sampled checks that prove the local tokenizer right per model."""
