import sys

from engine.cli import main

if __name__ == "__main__":  # guarded: a spawned worker (packaged.prepare_ahead) imports the main module again
    sys.exit(main())
