"""The textbook passage's walk-throughs as runnable examples (`sdpa demo` runs them).

Also in the repository's examples/ folder: `python examples/phrase.py`.
"""
