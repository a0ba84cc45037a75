from nsa_validate.cli import main

main()
