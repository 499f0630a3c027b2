"""The detokenizer process: token ids to text increments (text.py: IncrementalDetokenizer and
TextStream, also used in-process; process.py: the process' loop)."""
