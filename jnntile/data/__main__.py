from jnntile.data.cli import main

main()
