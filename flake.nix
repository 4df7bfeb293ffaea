{
  description = "prime-kernels: every member kernel built with kernel-builder";

  inputs = {
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";
  };

  outputs =
    { self, nixpkgs }:
    let
      system = "x86_64-linux";
      pkgs = nixpkgs.legacyPackages.${system};
      # build.toml's `workspace.members` is the one member list (the shim and the local builder
      # read it too).
      members = (builtins.fromTOML (builtins.readFile ./build.toml)).workspace.members;
      # Each member is its own kernel-builder flake; build-and-copy fills <member>/build/.
      buildAll = pkgs.writeShellApplication {
        name = "prime-kernels-build";
        text = ''
          for member in ${pkgs.lib.concatStringsSep " " members}; do
            echo "building $member with kernel-builder"
            (cd "$member" && nix run -L .#build-and-copy)
          done
        '';
      };
    in
    {
      apps.${system}.build = {
        type = "app";
        program = "${buildAll}/bin/prime-kernels-build";
      };
      packages.${system}.default = buildAll;
      # What `nix run .#build` walks, for checks that evaluate this flake.
      lib.members = members;
    };
}
