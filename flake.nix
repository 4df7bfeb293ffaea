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
      # Keep in step with `workspace.members` in build.toml.
      members = [ "rmsnorm" "flash_moe" ];
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
    };
}
