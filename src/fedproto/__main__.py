"""``python -m fedproto``: the ``fedproto`` command (:func:`fedproto.cli.app.main`)."""

from fedproto.cli.app import main

if __name__ == "__main__":
    main()
