from multihead.cli import entry

entry()
