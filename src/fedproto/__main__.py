"""``python -m fedproto``: the ``fedproto`` command (:func:`fedproto.cli.main`)."""

from fedproto.cli import main

if __name__ == "__main__":
    main()
