"""record(): what a function or class made during a test, the call itself left as it was."""


def record(monkeypatch, owner, name: str, *more) -> list:
    """Wrap owner.name (and each further (owner, name) pair in `more`, the same callable imported elsewhere) so
    every call runs as before and its result is appended to the returned list."""
    made = []
    real = getattr(owner, name)

    def spy(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]
    for o, n in ((owner, name), *zip(more[::2], more[1::2])):
        monkeypatch.setattr(o, n, spy)
    return made
