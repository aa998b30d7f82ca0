"""`python -m cancelwatch`: the same command line as the `cancelwatch` script."""

from cancelwatch.cli import main

main()
