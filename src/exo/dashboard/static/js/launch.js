export function mountLaunch(section) {
  return {};
}
