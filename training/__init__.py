"""Training branch: corpus, BPE tokenizer, training loop, export to the Hugging Face layout.

May import model/; the server never imports training/."""
