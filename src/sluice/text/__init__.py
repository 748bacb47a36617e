"""Text in and out of a model: the tokenizer (tokenizer.py) and the files it reads (tokenizer_files.py),
the sandboxed chat template (chat_template.py) with its guards and limits, and the bounds a prompt's
text and tokens are checked against before any work (token_bound.py).

Nothing is imported here, so `sluice.text.token_bound` stays cheap for the command line.
"""
