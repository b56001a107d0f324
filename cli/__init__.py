"""The command-line front: the `pdserve` command (main.py), `pdserve up`'s local cluster (up.py, its settings
in up_options.py, the throwaway Redis in redis_launch.py) and `pdserve bench` (bench*.py). It imports the
roles and the router; nothing below it imports this package, except each role's `__main__`, which hands its
command line to the `pdserve` command."""
