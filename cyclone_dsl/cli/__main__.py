from cyclone_dsl.cli.main import main

main()
