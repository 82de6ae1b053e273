from vlp.cli import run

if __name__ == "__main__":  # guarded: `vlp compare` worker processes (spawn) import this module again
    run()
