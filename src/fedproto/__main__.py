from fedproto.cli import main

main()
